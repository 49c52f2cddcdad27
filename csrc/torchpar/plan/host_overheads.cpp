#include <torchpar/plan/host_overheads.h>

#include <torchpar/common/generator_state.h>
#include <torchpar/plan/profile.h>
#include <torchpar/plan/verify_on_ranks.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randn.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <functional>
#include <string>

namespace torchpar::plan {
namespace {

constexpr int kSamplesPerRank = 16;
constexpr int kMicrobatches = 4;
// Steps of a few milliseconds each: their median over many, after the process's first steps of a new engine.
constexpr int kPipelineSteps = 60;
constexpr int kDataParallelSteps = 20;

std::vector<pipeline::LayerFactory> linear_layers(int layers, int64_t width) {
  std::vector<pipeline::LayerFactory> factories;
  for (int i = 0; i < layers; ++i) {
    factories.push_back([i, width] {
      torch::manual_seed(static_cast<uint64_t>(i));
      return pipeline::layer_from_module("linear" + std::to_string(i),
                                         torch::nn::AnyModule(torch::nn::Linear(width, width)));
    });
  }
  return factories;
}

// The value in [0, largest] at which the (growing) prediction meets the measurement: bisection.
double solve(const std::function<double(double)>& predicted_ms, double measured_ms, double largest) {
  double low = 0, high = largest;
  if (predicted_ms(low) >= measured_ms) return low;
  for (int i = 0; i < 30; ++i) {
    const double middle = (low + high) / 2;
    (predicted_ms(middle) < measured_ms ? low : high) = middle;
  }
  return low;
}

// (Every rank; the answer on rank 0.) `configuration` of `factories` run for real, then the value of the
// calibration's `knob`, within the range fit_calibration searches, under which the cost model predicts the step
// measured; the run joins `samples` (rank 0).
double fitted(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
              const std::vector<pipeline::LayerFactory>& factories, int64_t width, const Configuration& configuration,
              const NetworkProfile& network, const Calibration& calibration, const char* knob_name, int steps,
              std::vector<CalibrationSample>& samples) {
  const int world = group->getSize();
  torch::manual_seed(static_cast<uint64_t>(1000 + group->getRank()));
  const TrainingRun run{{at::randn({kSamplesPerRank, width})}, at::randn({kSamplesPerRank, width}),
                        [](const pipeline::Tensors& outputs, const at::Tensor& target) {
                          return at::mse_loss(outputs[0], target);
                        },
                        {}};
  TrainingSetup setup;
  setup.batch = static_cast<int64_t>(kSamplesPerRank) * world;
  const auto measured = verify_on_ranks(group, factories, run, configuration, setup, std::max(2, steps / 6), steps);
  if (group->getRank() != 0) return 0;
  const auto model = profile_layers(factories, run.inputs, /*repeats=*/5, &setup);
  samples.push_back({model, network, setup, configuration, measured.step_ms});
  const auto& knobs = calibration_knobs();
  const auto knob = std::find_if(knobs.begin(), knobs.end(), [&](const CalibrationKnob& candidate) {
    return std::string(candidate.name) == knob_name;
  });
  TORCH_INTERNAL_ASSERT(knob != knobs.end(), "no calibration knob ", knob_name);
  Calibration trial = calibration;
  return knob->low + solve(
                         [&](double above_lowest) {
                           trial.*(knob->field) = knob->low + above_lowest;
                           return predict(model, network, setup, configuration, trial).step_ms;
                         },
                         measured.step_ms, knob->high - knob->low);
}

} // namespace

std::vector<CalibrationSample> measure_host_overheads(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                      const NetworkProfile& network, Calibration& calibration) {
  std::vector<CalibrationSample> samples;
  const int world = group->getSize();
  if (world < 2) return samples;
  // The probes seed their layers and samples: the program's random stream goes on afterwards as if they never ran.
  const GeneratorStateGuard random_stream(at::detail::getDefaultCPUGenerator().get_state());
  const bool answering = group->getRank() == 0;  // the others measure with it, their answers unused
  Configuration ddp;
  ddp.world = world;
  const double scale = fitted(group, linear_layers(4, 512), 512, ddp, network, calibration, "communication_scale",
                              kDataParallelSteps, samples);
  if (answering) calibration.communication_scale = scale;
  Configuration pipe;
  pipe.strategy = Strategy::Pipeline;
  pipe.world = world;
  pipe.microbatches = kMicrobatches;
  pipe.balance = std::vector<int64_t>(static_cast<size_t>(world), 1);
  const double per_action_ms =
      fitted(group, linear_layers(world, 8), 8, pipe, network, calibration, "per_action_ms", kPipelineSteps, samples);
  if (answering) calibration.per_action_ms = per_action_ms;
  return samples;
}

} // namespace torchpar::plan
