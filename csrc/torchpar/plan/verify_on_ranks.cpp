#include <torchpar/plan/verify_on_ranks.h>

#include <torchpar/common/cpu_allocations.h>
#include <torchpar/comm/process_group.h>
#include <torchpar/ddp/replica_coordinator.h>
#include <torchpar/pipeline/pipeline.h>
#include <torchpar/sharded/sharded_coordinator.h>
#include <torchpar/sharded/sharded_optimizer.h>
#include <torchpar/tensor_parallel/parallel_grid.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

namespace torchpar::plan {
namespace {

// A field of /proc/self/status in KiB (VmRSS, VmHWM), where Linux tells it.
std::optional<int64_t> status_kib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      std::istringstream value(line.substr(field.size() + 1));
      int64_t kib = 0;
      if (value >> kib) return kib;
    }
  }
  return std::nullopt;
}

// Freed memory handed back first (the block cache's and the heap's), so that what an earlier configuration left
// does not hide this one's growth; the high-water mark reset to the resident set now, which is returned (KiB).
std::optional<int64_t> start_resident_watch() {
  release_freed_memory();
  malloc_trim(0);
  std::ofstream clear_refs("/proc/self/clear_refs");
  if (!(clear_refs << "5" << std::flush)) return std::nullopt;
  return status_kib("VmRSS");
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainingRun& run, const TrainingSetup& setup,
                                                        std::vector<at::Tensor> parameters) {
  if (run.optimizer) return run.optimizer(std::move(parameters));
  if (setup.optimizer_state_factor >= 2) {
    return std::make_unique<torch::optim::Adam>(std::move(parameters), torch::optim::AdamOptions(1e-3));
  }
  return std::make_unique<torch::optim::SGD>(std::move(parameters), torch::optim::SGDOptions(1e-3).momentum(0.9));
}

double median_step_ms(const std::function<void()>& step, int warmup, int steps) {
  for (int i = 0; i < warmup; ++i) step();
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    step();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

// Every layer built, its trained parameters named "layer<i>.<name>" (a unit per layer at stage 3).
struct BuiltLayers {
  std::vector<pipeline::Layer> layers;
  NamedTensors parameters;
  std::vector<std::string> units;  // the layers holding trained parameters
};

BuiltLayers build_layers(const std::vector<pipeline::LayerFactory>& factories) {
  BuiltLayers built;
  for (size_t i = 0; i < factories.size(); ++i) {
    built.layers.push_back(factories[i]());
    const auto& layer = built.layers.back();
    const std::string unit = "layer" + std::to_string(i);
    bool trained = false;
    for (size_t j = 0; j < layer.parameters.size(); ++j) {
      const auto name = j < layer.parameter_names.size() ? layer.parameter_names[j] : std::to_string(j);
      built.parameters.emplace_back(unit + "." + name, layer.parameters[j]);
      trained = trained || layer.parameters[j].requires_grad();
    }
    if (trained) built.units.push_back(unit);
  }
  return built;
}

double data_parallel_step_ms(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                             const std::vector<pipeline::LayerFactory>& factories, const TrainingRun& run,
                             const TrainingSetup& setup, int warmup, int steps) {
  auto built = build_layers(factories);
  ddp::ReplicaCoordinator coordinator(built.parameters, {},
                                      ddp::DistributedDataParallelOptions().process_group(group));
  std::vector<at::Tensor> parameters;
  for (const auto& entry : built.parameters) parameters.push_back(entry.second);
  auto optimizer = make_optimizer(run, setup, parameters);
  return median_step_ms(
      [&] {
        optimizer->zero_grad();
        const bool will_sync = coordinator.will_sync();
        coordinator.pre_forward(will_sync);
        auto values = run.inputs;
        for (const auto& layer : built.layers) values = layer.forward(values);
        coordinator.post_forward(values, will_sync);
        run.loss(values, run.target).backward();
        optimizer->step();
      },
      warmup, steps);
}

double sharded_step_ms(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                       const std::vector<pipeline::LayerFactory>& factories, const TrainingRun& run,
                       const TrainingSetup& setup, int stage, int warmup, int steps) {
  auto built = build_layers(factories);
  auto options = sharded::ShardedOptions().process_group(group).stage(stage);
  if (stage == 3) options.units(built.units);
  std::vector<at::Tensor> parameters;
  for (const auto& entry : built.parameters) parameters.push_back(entry.second);
  // As ShardedDataParallel runs it (and measure_network costs it): through an shm group beside a Gloo group.
  sharded::ShardedCoordinator coordinator(built.parameters, {},
                                          sharded::through_same_host_group(std::move(options), parameters));
  sharded::ShardedOptimizer optimizer(coordinator, make_optimizer(run, setup, coordinator.shard()));
  // Each layer's unit number at stage 3 (0: none of its own), as ShardedDataParallel's Sequential forward goes.
  std::vector<int> unit_of_layer(built.layers.size(), 0);
  if (stage == 3) {
    for (size_t i = 0, unit = 0; i < built.layers.size(); ++i) {
      if (unit < built.units.size() && built.units[unit] == "layer" + std::to_string(i)) {
        unit_of_layer[i] = static_cast<int>(++unit);
      }
    }
  }
  return median_step_ms(
      [&] {
        optimizer.zero_grad();
        coordinator.pre_forward(coordinator.will_sync());
        auto values = run.inputs;
        for (size_t i = 0; i < built.layers.size(); ++i) {
          const int unit = unit_of_layer[i];
          if (unit > 0) coordinator.before_unit_forward(unit);
          values = built.layers[i].forward(values);
          if (unit > 0) {
            coordinator.after_unit_forward(unit);
            if (values.size() == 1) coordinator.gather_before_backward_of(unit, values.front());
          }
        }
        run.loss(values, run.target).backward();
        optimizer.step();
      },
      warmup, steps);
}

// `copies` of each tensor one after another along the batch dimension.
pipeline::Tensors repeated(const pipeline::Tensors& tensors, int copies) {
  pipeline::Tensors out;
  for (const auto& tensor : tensors) out.push_back(at::cat(std::vector<at::Tensor>(copies, tensor)));
  return out;
}

double pipeline_step_ms(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                        const std::vector<pipeline::LayerFactory>& factories, const TrainingRun& run,
                        const Configuration& configuration, const TrainingSetup& setup, int warmup, int steps) {
  const int world = group->getSize();
  const int replicas = configuration.replicas;
  auto options = pipeline::PipelineOptions()
                     .schedule(pipeline::schedule_name(configuration.schedule))
                     .microbatches(configuration.microbatches)
                     .virtual_stages(configuration.virtual_stages)
                     .balance(configuration.balance);
  std::optional<tensor_parallel::ParallelGrid> grid;
  if (replicas > 1) {
    grid.emplace(group, replicas, world / replicas, 1, comm::InitOptions().backend(group->getBackendName()));
    options.process_group(grid->pipeline_group()).data_parallel_group(grid->data_group());
  } else {
    options.process_group(group);
  }
  pipeline::Pipeline pipe(factories, run.loss, options);
  auto optimizer = make_optimizer(run, setup, pipe.parameters());
  // A replica computes the samples of its world / replicas ranks under data parallelism.
  const auto inputs = repeated(run.inputs, world / replicas);
  const auto target = repeated({run.target}, world / replicas).front();
  return median_step_ms(
      [&] {
        optimizer->zero_grad();
        pipe.step(inputs, target);
        optimizer->step();
      },
      warmup, steps);
}

} // namespace

bool verifiable_on_ranks(const Configuration& configuration) {
  switch (configuration.strategy) {
    case Strategy::DataParallel:
    case Strategy::Sharded:
      return true;
    case Strategy::Pipeline:
      return configuration.tensor == 1;
    default:
      return false;
  }
}

Measured verify_on_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                         const std::vector<pipeline::LayerFactory>& factories, const TrainingRun& run,
                         const Configuration& configuration, const TrainingSetup& setup, int warmup, int steps) {
  TORCH_CHECK(group, "verify_on_ranks: no process group");
  TORCH_CHECK(verifiable_on_ranks(configuration), "verify_on_ranks: ", configuration.describe(),
              " is verified by `python -m torchpar.plan --verify`, not from C++ (DDP, ZeRO and pipelines without "
              "tensor groups are)");
  TORCH_CHECK(configuration.world == group->getSize(), "verify_on_ranks: ", configuration.describe(), " is for ",
              configuration.world, " ranks, the group has ", group->getSize());
  TORCH_CHECK(steps >= 1 && warmup >= 0, "verify_on_ranks: ", steps, " timed steps after ", warmup);
  TORCH_CHECK(run.loss, "verify_on_ranks: the run has no loss");
  group->barrier()->wait();
  const auto resident_before = start_resident_watch();
  const bool counting = counting_cpu_allocations();
  const int64_t allocated_before = counting ? cpu_allocations().current : 0;
  if (counting) reset_cpu_allocation_peak();
  double step_ms = 0;
  switch (configuration.strategy) {
    case Strategy::DataParallel:
      step_ms = data_parallel_step_ms(group, factories, run, setup, warmup, steps);
      break;
    case Strategy::Sharded:
      step_ms = sharded_step_ms(group, factories, run, setup, configuration.zero_stage, warmup, steps);
      break;
    default:
      step_ms = pipeline_step_ms(group, factories, run, configuration, setup, warmup, steps);
      break;
  }
  const auto resident_peak = status_kib("VmHWM");
  const double grown = resident_before && resident_peak ? static_cast<double>(*resident_peak - *resident_before) * 1024
                                                        : 0.0;
  const double allocated = counting ? static_cast<double>(cpu_allocations().peak - allocated_before) : 0.0;
  // The slowest rank's step, the fullest rank's memory.
  std::vector<at::Tensor> largest{at::tensor({step_ms, allocated, grown}, at::kDouble)};
  c10d::AllreduceOptions maximum;
  maximum.reduceOp = c10d::ReduceOp::MAX;
  group->allreduce(largest, maximum)->wait();
  const auto* values = largest.front().data_ptr<double>();
  return Measured{values[0], static_cast<int64_t>(values[1]), static_cast<int64_t>(values[2])};
}

} // namespace torchpar::plan
