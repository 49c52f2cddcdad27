// A planned configuration run for real for a few steps on the ranks at hand, from C++: the step time and memory
// that `python -m torchpar.plan --verify` measures, for the engines a LibTorch program builds from layer factories
// (DDP, ZeRO stages 1-3 with each layer a unit at stage 3, pipelines with or without replicas).
//
//   plan::TrainingRun run{{x}, y, loss};                     // one rank's samples under data parallelism
//   auto measured = plan::verify_on_ranks(group, factories, run, configuration, setup);
//   measured.step_ms;                                        // the slowest rank's median step
//
// plan_on_ranks.h's verify_plan_on_ranks runs the top of a plan so, keeps each as a calibration sample and
// re-plans with what they taught.
#pragma once
#include <torchpar/common/c10d_fwd.h>
#include <torchpar/pipeline/layer.h>
#include <torchpar/pipeline/stage.h>
#include <torchpar/plan/cost_model.h>

#include <functional>
#include <memory>
#include <vector>

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace torchpar::plan {

using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

struct TrainingRun {
  pipeline::Tensors inputs;  // the samples one rank computes under data parallelism: setup.batch / world of them
  at::Tensor target;         // their targets
  pipeline::LossFn loss;     // (the last layer's outputs, target) -> the mean loss
  // The optimizer over the tensors given (a ZeRO rank's: its shard). Unset: the one the setup's optimizer state
  // implies, as the profile times it (Adam for 2 bytes per parameter byte or more, else SGD with momentum).
  OptimizerFactory optimizer;
};

struct Measured {
  double step_ms = 0;           // the slowest rank's median step
  int64_t allocated_bytes = 0;  // the fullest rank's peak of CPU tensor memory above where it stood (0: not counted)
  int64_t resident_bytes = 0;   // the fullest rank's resident-set growth above where it stood (0: /proc did not tell)
};

// Whether verify_on_ranks builds `configuration` (tensor parallelism and the parameter server: Python's --verify).
bool verifiable_on_ranks(const Configuration& configuration);

// Every rank of `group` calls it with the same configuration: builds it from `factories` (a pipeline's at the
// configuration's cut, schedule and micro-batches), trains `warmup` steps untimed and `steps` timed, and returns
// what the slowest and fullest ranks measured. Throws naming the configuration where it is not verifiable here.
Measured verify_on_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                         const std::vector<pipeline::LayerFactory>& factories, const TrainingRun& run,
                         const Configuration& configuration, const TrainingSetup& setup, int warmup = 2,
                         int steps = 5);

} // namespace torchpar::plan
