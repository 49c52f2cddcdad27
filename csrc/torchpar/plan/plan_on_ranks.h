// Planning from a C++ program, on the ranks that will train: rank 0 profiles the model's layers (alone, the other
// ranks waiting), every rank times whole passes and the group's operations, rank 0 plans, and every rank gets the
// top configuration — the steps `python -m torchpar.plan` takes, without its --verify and calibration store.
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
#include <torchpar/plan/planner.h>

namespace torchpar::plan {

struct PlannedOnRanks {
  Plan plan;             // rank 0's whole plan; on the other ranks, empty
  Configuration chosen;  // the top configuration (with its cut), the same on every rank
};

// `sample`: the inputs of the samples one rank computes under data parallelism (setup.batch / world of them);
// `options.world()` is set to the group's size. The optimizer is timed as `setup.optimizer_state_factor` says
// (Adam for 2 or more, else SGD with momentum). Throws on every rank when no configuration fits, with rank 0's
// reasons. Every rank of `group` calls it.
PlannedOnRanks plan_on_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                             const std::vector<pipeline::LayerFactory>& factories, const pipeline::Tensors& sample,
                             PlanOptions options, TrainingSetup setup);

} // namespace torchpar::plan
