// The schedules, as pure functions from (ranks, micro-batches, virtual stages, rank) to that rank's
// ordered actions. Virtual stage k lives on rank k % ranks (Megatron's interleaved placement; with one
// virtual stage per rank, stage k is rank k).
#pragma once
#include <torchpar/pipeline/action.h>

#include <string>
#include <vector>

namespace torchpar::pipeline {

enum class ScheduleKind {
  GPipe,            // all forwards, then all backwards: m micro-batches of activations alive
  OneFOneB,         // PipeDream-Flush: warm-up forwards, then alternate; at most `ranks` alive
  Interleaved1F1B,  // Megatron's interleaved 1F1B over v virtual stages per rank: bubble / v
  ZeroBubbleH1,     // Qi et al. 2023, ZB-H1: backward split into I and W, W fills the bubble
};

struct ScheduleSpec {
  ScheduleKind kind = ScheduleKind::OneFOneB;
  int ranks = 1;           // pipeline ranks (p)
  int microbatches = 1;    // per step (m)
  int virtual_stages = 1;  // stages per rank (v); > 1 only for Interleaved1F1B

  int stages() const { return ranks * virtual_stages; }
};

// Every schedule's name, in ScheduleKind's order: "gpipe", "1f1b", "interleaved", "zero_bubble" (what
// the Python API and the command lines offer).
std::vector<std::string> schedule_names();
// A name of schedule_names(), any case, '-' for '_', or an alias ("interleaved_1f1b", "zb_h1" ...);
// throws on others, listing the names.
ScheduleKind parse_schedule(const std::string& name);
std::string schedule_name(ScheduleKind kind);

// Throws, naming the schedule and the numbers, when the spec cannot run (e.g. interleaved with
// micro-batches not a multiple of the ranks, or more than one virtual stage outside interleaved).
void check_schedule(const ScheduleSpec& spec);

inline int rank_of_stage(int stage, int ranks) { return stage % ranks; }

// The compute actions (F, B, I, W) of `rank`, in execution order.
std::vector<Action> compute_actions(const ScheduleSpec& spec, int rank);

// The compute actions of `rank` with the communication the runtime needs inserted: a RECV is posted
// one compute action before the action that consumes it (so the transfer overlaps that compute),
// a SEND right after the action that produced it.
std::vector<Action> rank_actions(const ScheduleSpec& spec, int rank);

// rank_actions for every rank.
std::vector<std::vector<Action>> all_rank_actions(const ScheduleSpec& spec);

} // namespace torchpar::pipeline
