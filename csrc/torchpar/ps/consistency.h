#pragma once
// A parameter server's consistency rules, apart from its messages, threads and timers: what each
// worker pushed to each table for which clock, which reads may be answered now (BSP: once their
// round is applied; SSP: within the staleness bound of the slowest worker; ASP: at once), when a BSP
// round is full and applied, and which workers are dropped for holding the others up. The time is
// an argument, so tests replay any interleaving of workers in-process.
#include <torchpar/ps/config.h>
#include <torchpar/ps/messages.h>
#include <torchpar/ps/table.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace torchpar::ps {

enum class WorkerState { Active, Finished, Lost };

// A request whose reads wait for other workers, as the drop rule sees it.
struct WaitingRead {
  int worker = 0;
  std::chrono::steady_clock::time_point since;
};

struct Drop {
  int worker = 0;
  std::string reason;
};

class ConsistencyEngine {
 public:
  using Clock = std::chrono::steady_clock;

  // `timeout`: how long the others wait for a worker before it is dropped (see late_workers).
  ConsistencyEngine(Consistency model, int staleness, std::chrono::milliseconds timeout, int num_workers,
                    Clock::time_point now);

  Consistency model() const { return model_; }
  int num_workers() const { return static_cast<int>(states_.size()); }
  WorkerState state(int worker) const { return states_[worker]; }
  bool any_active() const { return active_count() > 0; }
  int active_count() const;
  bool any_finished() const;

  void heard_from(int worker, Clock::time_point now) { last_heard_[worker] = now; }
  void finish(int worker) { states_[worker] = WorkerState::Finished; }
  // False when the worker had already finished or been lost.
  bool lose(int worker);

  // The worker's push to `table` at its next clock. `ids` (sparse tables; undefined for dense) and
  // `grads` may point into a request: applied at once (ASP, SSP) or copied to wait for their round (BSP).
  void contribute(int worker, Table& table, at::Tensor ids, at::Tensor grads, Clock::time_point now) const;
  // BSP: applies, table by table and in clock order, every round each active worker has pushed to;
  // `applied` sees the table after each round. True when any round was applied.
  bool apply_full_rounds(const Tables& tables, const std::function<void(Table&)>& applied) const;

  // Whether a read of `table` at `clock` (the reader's pushes to it) may be answered now.
  bool ready(const Table& table, int64_t clock) const;
  // Whether every read of `request` may be answered now (a push_pull reads after its own push).
  bool readable(const Request& request, const Tables& tables) const;
  // The fewest pushes of an active worker to `table`; int64 max when no worker is active.
  int64_t slowest_clock(const Table& table) const;
  // The clock every active worker has reached on every table someone pushes to (read-only tables do
  // not hold it back); empty when no worker is active or nobody pushed.
  std::optional<int64_t> common_clock(const Tables& tables) const;

  // The workers that hold the others up for longer than the timeout, to be dropped now.
  // BSP: those that have not pushed to the oldest open round of the first table whose round waited
  // that long. ASP / SSP: a silent worker holds things up only when the others wait for it (a read
  // waiting that long, or the service's end once it is the only active worker); then those silent
  // for that long are dropped, except workers whose own reads wait (quiet, not silent).
  std::vector<Drop> late_workers(const Tables& tables, const std::vector<WaitingRead>& waiting,
                                 Clock::time_point now) const;

  // A table restored from a checkpoint: BSP rounds need every worker at the table's round, so a
  // checkpoint of an ASP / SSP job resumes from its slowest worker's clock.
  void resume_restored(Table& table) const;

 private:
  Consistency model_;
  int staleness_;
  std::chrono::milliseconds timeout_;
  std::vector<WorkerState> states_;
  std::vector<Clock::time_point> last_heard_; // each worker's last message
};

} // namespace torchpar::ps
