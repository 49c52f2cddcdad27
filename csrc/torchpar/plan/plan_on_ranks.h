// Planning from a C++ program, on the ranks that will train: rank 0 profiles the model's layers (alone, the other
// ranks waiting), every rank times whole passes and the group's operations, rank 0 plans, and every rank gets the
// top configuration — the steps `python -m torchpar.plan` takes: with the calibration that earlier --verify runs
// on this machine kept (calibration_store.h), else the default one with the engines' host time measured on these
// ranks (host_overheads.h). verify_plan_on_ranks below is its --verify.
//
//   plan::TrainingSetup setup;
//   setup.batch = 64;                                              // global samples per step
//   auto planned = plan::plan_on_ranks(group, layer_factories, {per_rank_batch}, plan::PlanOptions()
//                                          .memory_per_rank(64LL << 20), setup);
//   if (group->getRank() == 0) std::cout << plan::render_table(planned.plan);
//   planned.chosen;                                                // the same configuration on every rank
#pragma once
#include <torchpar/common/c10d_fwd.h>
#include <torchpar/pipeline/layer.h>
#include <torchpar/plan/calibration_store.h>
#include <torchpar/plan/planner.h>
#include <torchpar/plan/verify_on_ranks.h>

namespace torchpar::plan {

struct PlannedOnRanks {
  Plan plan;             // rank 0's whole plan; on the other ranks, empty
  Configuration chosen;  // the top configuration (with its cut), the same on every rank
  Calibration calibration;  // what rank 0 predicted with
  // From the store; false: default_calibration with the engines' host time measured on these ranks
  // (host_overheads.h), whose runs are `probes` (rank 0).
  bool calibration_learned = false;
  std::vector<CalibrationSample> probes;
  // What the plan was made from, for verify_plan_on_ranks to keep with each measurement and plan again from: the
  // setup and options on every rank; the model's profile and the network rank 0's (empty on the others).
  ModelProfile model;
  NetworkProfile network;
  TrainingSetup setup;
  PlanOptions options;
};

// `sample`: the inputs of the samples one rank computes under data parallelism (setup.batch / world of them);
// `options.world()` is set to the group's size. The optimizer is timed as `setup.optimizer_state_factor` says
// (Adam for 2 or more, else SGD with momentum). The calibration is looked up in `store` under the group's backend
// name and size. Throws on every rank when no configuration fits, with rank 0's reasons. Every rank of `group`
// calls it.
PlannedOnRanks plan_on_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                             const std::vector<pipeline::LayerFactory>& factories, const pipeline::Tensors& sample,
                             PlanOptions options, TrainingSetup setup,
                             const CalibrationStore& store = CalibrationStore());

struct VerifiedConfiguration {
  Configuration configuration;  // with its cut
  double predicted_ms = 0;      // rank 0's prediction before (0 on the other ranks)
  int64_t predicted_tensor_bytes = 0;
  Measured measured;            // the same on every rank
};

struct VerifiedPlan {
  std::vector<VerifiedConfiguration> verified;
  // Planned again with the calibration fitted to the store's samples, these included (rank 0's plan; `chosen`
  // on every rank).
  PlannedOnRanks replanned;
  int calibration_samples = 0;  // how many samples that calibration rests on (rank 0)
};

// `python -m torchpar.plan --verify K` from C++: the first `top` configurations of `planned` that C++ builds
// (verifiable_on_ranks; the others are skipped) run for `steps` timed steps each, every one kept in `store` as
// a calibration sample under the group's backend, and the model planned again with the calibration fitted to
// them and to what earlier runs on this machine kept, from the default calibration with the engines' host time
// measured on these ranks (where `planned` used a learned one, measured now). Every rank of `group` calls it after
// plan_on_ranks; a store that cannot be read or written fails every rank (rank 0 saying why).
VerifiedPlan verify_plan_on_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                  const std::vector<pipeline::LayerFactory>& factories, const TrainingRun& run,
                                  const PlannedOnRanks& planned, int top, CalibrationStore store = CalibrationStore(),
                                  int steps = 5);

} // namespace torchpar::plan
