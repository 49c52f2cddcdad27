#include <torchpar/plan/profile.h>

#include <torchpar/pipeline/same_host_rings.h>
#include <torchpar/ps/channel.h>
#include <torchpar/common/cpu_allocations.h>
#include <torchpar/common/memfd_region.h>
#include <torchpar/comm/process_group.h>

#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <numeric>

namespace torchpar::plan {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kSmallMessageBytes = 64 << 10;

double elapsed_ms(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

int64_t bytes_of(const pipeline::Tensors& tensors) {
  int64_t bytes = 0;
  for (const auto& tensor : tensors) bytes += static_cast<int64_t>(tensor.nbytes());
  return bytes;
}

// The outputs backward can start from (those that require grad).
pipeline::Tensors requiring_grad(const pipeline::Tensors& outputs) {
  pipeline::Tensors roots;
  for (const auto& output : outputs) {
    if (output.requires_grad()) roots.push_back(output);
  }
  return roots;
}

// `repeats` timed runs of `run` (ms), after one untimed (allocations, lazy initialisation).
std::vector<double> timed_runs_ms(int repeats, const std::function<void()>& run) {
  run();
  std::vector<double> samples;
  for (int i = 0; i < repeats; ++i) {
    const auto start = Clock::now();
    run();
    samples.push_back(elapsed_ms(start));
  }
  return samples;
}

double median_ms(int repeats, const std::function<void()>& run) {
  return median(timed_runs_ms(repeats, run));
}

// For the process group's operations: a step sums many of them, so its time holds their means, and
// their times have a long tail (Gloo's all-reduce of 4 KiB on 2 ranks of this 2-core machine: median
// 0.40 ms, mean 1.78 ms, p90 4.0 ms). But a run counts at most 20 x the median: a few stalls of tens of
// milliseconds (the machine's neighbours) made one plan's transfer α 2.5 ms where others read 0.05-0.3,
// and leaving out the slowest tenth instead cut the all-reduce's real tail (2 ranks: α 0.4-0.6 ms, steps
// of tensor parallelism then predicted 50% fast).
double mean_without_stalls_ms(int repeats, const std::function<void()>& run) {
  auto samples = timed_runs_ms(repeats, run);
  const double most = 20 * median(samples);
  double sum = 0;
  for (const double sample : samples) sum += std::min(sample, most);
  return sum / static_cast<double>(samples.size());
}

// The first layer's embedding tables as a parameter server would hold them: the rows its integer inputs (the
// model's) look up per sample. None without integer inputs.
void set_sparse_tables(const pipeline::LayerTraits& traits, const pipeline::Tensors& sample, LayerProfile& profile) {
  int64_t ids = 0;
  for (const auto& tensor : sample) {
    if (!c10::isFloatingType(tensor.scalar_type()) && tensor.dim() > 0) ids += tensor.numel();
  }
  if (ids == 0 || traits.embedding_bytes == 0) return;
  profile.sparse_parameter_bytes = traits.embedding_bytes;
  profile.sparse_bytes_per_sample = ids / sample[0].size(0) * traits.embedding_row_bytes;
}

// One pass of profiling at the sample's batch; `all_parameters` collects the layers' parameters. With
// `chained_activations` (and CPU allocations counted), each layer's activations are measured on the layers chained.
ModelProfile profile_at(const std::vector<pipeline::LayerFactory>& factories, const pipeline::Tensors& sample,
                        int repeats, std::vector<at::Tensor>& all_parameters, bool chained_activations) {
  ModelProfile model;
  model.batch = sample[0].size(0);
  pipeline::Tensors current = sample;
  std::vector<pipeline::Layer> built;
  for (size_t index = 0; index < factories.size(); ++index) {
    pipeline::Layer layer = factories[index]();
    pipeline::Tensors inputs, differentiable;
    for (const auto& tensor : current) {
      const bool floating = c10::isFloatingType(tensor.scalar_type());
      inputs.push_back(floating ? tensor.detach().requires_grad_(true) : tensor);
      if (floating) differentiable.push_back(inputs.back());
    }
    LayerProfile profile;
    profile.name = layer.name;
    for (const auto& parameter : layer.parameters) profile.parameter_bytes += static_cast<int64_t>(parameter.nbytes());
    profile.in_features = layer.traits.split_in_features;
    profile.out_features = layer.traits.split_out_features;
    profile.elementwise = layer.traits.elementwise;
    profile.accumulates_weight_gradient = layer.accumulates_weight_gradient;
    if (index == 0) set_sparse_tables(layer.traits, sample, profile);
    pipeline::Tensors outputs;
    profile.forward_ms = median_ms(repeats, [&] { outputs = layer.forward(inputs); });
    pipeline::Tensors seeds;
    for (const auto& root : requiring_grad(outputs)) seeds.push_back(at::ones_like(root));
    if (!seeds.empty()) {
      // Each timed backward gets a fresh graph: its forward runs outside the timing.
      const auto backward_ms = [&](const std::function<void(const pipeline::Tensors&)>& backward) {
        std::vector<double> samples;
        for (int run = 0; run <= repeats; ++run) {
          const auto fresh_roots = requiring_grad(layer.forward(inputs));
          const auto start = Clock::now();
          backward(fresh_roots);
          if (run > 0) samples.push_back(elapsed_ms(start));
        }
        return median(samples);
      };
      const double whole = backward_ms([&](const pipeline::Tensors& r) { torch::autograd::backward(r, seeds); });
      const double input_only =
          differentiable.empty() ? 0.0 : backward_ms([&](const pipeline::Tensors& r) {
            torch::autograd::grad(r, differentiable, seeds, /*retain_graph=*/false, /*create_graph=*/false,
                                  /*allow_unused=*/true);
          });
      if (counting_cpu_allocations()) {
        // One more backward, its allocations counted: what it holds at its peak beyond the gradients it leaves.
        for (auto& parameter : layer.parameters) parameter.mutable_grad() = at::Tensor();
        for (auto& input : differentiable) input.mutable_grad() = at::Tensor();
        const auto roots = requiring_grad(layer.forward(inputs));
        reset_cpu_allocation_peak();
        const int64_t before = cpu_allocations().current;
        torch::autograd::backward(roots, seeds);
        int64_t gradients = 0;
        for (const auto& parameter : layer.parameters) {
          if (parameter.grad().defined()) gradients += static_cast<int64_t>(parameter.grad().nbytes());
        }
        for (const auto& input : differentiable) {
          if (input.grad().defined()) gradients += static_cast<int64_t>(input.grad().nbytes());
        }
        profile.backward_temporary_bytes = std::max<int64_t>(0, cpu_allocations().peak - before - gradients);
      }
      profile.backward_input_ms = std::min(input_only, whole);
      profile.backward_weight_ms = layer.parameters.empty() ? 0.0 : whole - profile.backward_input_ms;
      if (layer.parameters.empty()) profile.backward_input_ms = whole;
    }
    profile.input_bytes = bytes_of(inputs);
    profile.output_bytes = bytes_of(outputs);
    profile.activation_bytes = profile.output_bytes;
    model.layers.push_back(profile);
    for (auto& parameter : layer.parameters) {
      all_parameters.push_back(parameter);
      parameter.mutable_grad() = at::Tensor();
    }
    current.clear();
    for (const auto& output : outputs) current.push_back(output.detach());
    if (chained_activations) built.push_back(std::move(layer));
  }
  if (chained_activations && counting_cpu_allocations()) {
    // One forward through the layers chained, as the model runs them: what each leaves alive beyond the tensors
    // before it. Its input is the previous layer's output, which stays only if one of the two saved it.
    pipeline::Tensors chain = sample;
    int64_t alive = cpu_allocations().current;
    for (size_t index = 0; index < built.size(); ++index) {
      chain = built[index].forward(chain);
      const int64_t now = cpu_allocations().current;
      model.layers[index].activation_bytes = now - alive;
      alive = now;
    }
  }
  return model;
}

// The intercept at 0 samples of the line through (small, at_small) and (batch, at_batch), within [0, at_batch].
double overhead_ms(double at_batch, double at_small, int64_t batch, int64_t small) {
  const double slope = (at_batch - at_small) / static_cast<double>(batch - small);
  return std::clamp(at_batch - slope * static_cast<double>(batch), 0.0, at_batch);
}

} // namespace

ModelProfile profile_layers(const std::vector<pipeline::LayerFactory>& factories, const pipeline::Tensors& sample,
                            int repeats, TrainingSetup* setup) {
  TORCH_CHECK(!sample.empty() && sample[0].dim() > 0, "plan: the sample needs a batch dimension");
  TORCH_CHECK(repeats > 0, "plan: repeats must be positive");
  std::vector<at::Tensor> all_parameters, unused;
  ModelProfile model = profile_at(factories, sample, repeats, all_parameters, /*chained_activations=*/true);
  const int64_t small = model.batch / 8;
  if (small >= 1) {
    pipeline::Tensors fewer;
    for (const auto& tensor : sample) fewer.push_back(tensor.narrow(0, 0, small));
    // Its times only: their part that does not shrink with the samples.
    const ModelProfile few = profile_at(factories, fewer, repeats, unused, /*chained_activations=*/false);
    for (size_t i = 0; i < model.layers.size(); ++i) {
      auto& layer = model.layers[i];
      const auto& at_small = few.layers[i];
      layer.forward_overhead_ms = overhead_ms(layer.forward_ms, at_small.forward_ms, model.batch, small);
      layer.backward_input_overhead_ms =
          overhead_ms(layer.backward_input_ms, at_small.backward_input_ms, model.batch, small);
      layer.backward_weight_overhead_ms =
          overhead_ms(layer.backward_weight_ms, at_small.backward_weight_ms, model.batch, small);
    }
  }
  if (setup != nullptr && model.parameter_bytes() > 0) {
    std::vector<at::Tensor> copies;
    for (const auto& parameter : all_parameters) {
      auto copy = parameter.detach().clone().requires_grad_(true);
      copy.mutable_grad() = at::ones_like(copy);
      copies.push_back(copy);
    }
    // The optimizer the setup's state implies: Adam keeps two moments, SGD with momentum one.
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    if (setup->optimizer_state_factor >= 2) {
      optimizer = std::make_unique<torch::optim::Adam>(copies, torch::optim::AdamOptions(1e-6));
    } else {
      optimizer = std::make_unique<torch::optim::SGD>(copies, torch::optim::SGDOptions(1e-6).momentum(0.9));
    }
    setup->optimizer_ms_per_byte =
        median_ms(repeats, [&] { optimizer->step(); }) / static_cast<double>(model.parameter_bytes());
  }
  return model;
}

LinkCost fit_link_cost(const std::vector<double>& bytes, const std::vector<double>& milliseconds) {
  TORCH_CHECK(bytes.size() == milliseconds.size() && !bytes.empty(), "fit_link_cost: one time per size");
  // Least squares on the relative error (each point weighted by 1 / time²): a small message's time
  // counts as much as a large one's, where plain least squares would fit the largest and miss α.
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const double w = milliseconds[i] > 0 ? 1.0 / (milliseconds[i] * milliseconds[i]) : 0.0;
    sw += w;
    sx += w * bytes[i];
    sy += w * milliseconds[i];
    sxx += w * bytes[i] * bytes[i];
    sxy += w * bytes[i] * milliseconds[i];
  }
  LinkCost cost;
  if (sw == 0) return cost;
  const double spread = sw * sxx - sx * sx;
  cost.ms_per_byte = spread > 0 ? std::max(0.0, (sw * sxy - sx * sy) / spread) : 0.0;
  cost.alpha_ms = std::max(0.0, (sy - cost.ms_per_byte * sx) / sw);
  return cost;
}

NetworkProfile measure_network(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                               const std::vector<int64_t>& sizes_bytes, int repeats) {
  NetworkProfile network;
  if (group->getSize() < 2) return network;
  // The sharded C++ wrapper goes through an shm group beside a Gloo group of one host (sharded_data_parallel.h).
  network.reduce_scatter_clones_input = group->getBackendName() == "gloo" && !comm::shm_group_fits_beside(group);
  const int rank = group->getRank();
  // The slowest rank's time: every rank's median, maximised over the group.
  const auto slowest = [&](double mine) {
    std::vector<at::Tensor> value{at::full({1}, mine, at::kDouble)};
    group->allreduce(value, {c10d::ReduceOp::MAX})->wait();
    return value[0].item<double>();
  };
  const int world = group->getSize();
  // A collective the backend does not offer (c10::Error on every rank alike) is costed as an all-reduce.
  bool gathers = true, scatters = true;
  const auto timed_if = [&](bool& supported, const std::function<void()>& op) {
    if (!supported) return 0.0;
    try {
      return mean_without_stalls_ms(repeats, op);
    } catch (const c10::Error&) {
      supported = false;
      return 0.0;
    }
  };
  // The pipeline's transfers between neighbouring stage ranks of one host go through its rings, which
  // connect (for every rank or none) as the pipeline's would: ranks 0 and 1 are neighbours.
  const auto rings = pipeline::SameHostRings::connect(*group, pipeline::SameHostRings::default_ring_bytes());
  std::vector<double> sizes, all_reduce_ms, transfer_ms, ring_transfer_ms, copy_ms, all_gather_ms, reduce_scatter_ms;
  for (const int64_t size : sizes_bytes) {
    // Small transfers' means (where α comes from) over 4 times the runs: one slow wake-up of several
    // milliseconds in 25 runs of a 0.06 ms transfer made α 0.3 ms in every other plan here.
    const int transfers = size <= kSmallMessageBytes ? 4 * repeats : repeats;
    std::vector<at::Tensor> buffer{at::zeros({std::max<int64_t>(world, size / 4 / world * world)}, at::kFloat)};
    group->barrier()->wait();
    const double reduce = mean_without_stalls_ms(repeats, [&] { group->allreduce(buffer)->wait(); });
    // All-gather into, and reduce-scatter from, a tensor of the same bytes: a rank's piece is 1 / world.
    std::vector<at::Tensor> piece{buffer[0].narrow(0, 0, buffer[0].numel() / world).clone()};
    std::vector<std::vector<at::Tensor>> pieces{std::vector<at::Tensor>(world, piece[0])};
    for (auto& tensor : pieces[0]) tensor = at::empty_like(piece[0]);
    group->barrier()->wait();
    const double gather = timed_if(gathers, [&] { group->allgather(pieces, piece)->wait(); });
    group->barrier()->wait();
    const double scatter = timed_if(scatters, [&] { group->reduce_scatter(piece, pieces)->wait(); });
    group->barrier()->wait();
    // Half a round trip between ranks 0 and 1, through the group and through the rings.
    const auto half_pingpong_ms = [&](const auto& send, const auto& recv) {
      if (rank >= 2) return 0.0;
      return mean_without_stalls_ms(transfers, [&] {
        if (rank == 0) {
          send(1)->wait();
          recv(1)->wait();
        } else {
          recv(0)->wait();
          send(0)->wait();
        }
      }) / 2;
    };
    const double pingpong = half_pingpong_ms([&](int peer) { return group->send(buffer, peer, 0); },
                                             [&](int peer) { return group->recv(buffer, peer, 0); });
    group->barrier()->wait();
    if (rings) {
      ring_transfer_ms.push_back(slowest(half_pingpong_ms([&](int peer) { return rings->send(buffer[0], peer, 0); },
                                                          [&](int peer) { return rings->recv(buffer[0], peer, 0); })));
      group->barrier()->wait();
    }
    auto destination = at::empty_like(buffer[0]);
    const double copy = mean_without_stalls_ms(repeats, [&] { destination.copy_(buffer[0]); });
    sizes.push_back(static_cast<double>(buffer[0].nbytes()));
    all_reduce_ms.push_back(slowest(reduce));
    transfer_ms.push_back(slowest(pingpong));
    copy_ms.push_back(slowest(copy));
    all_gather_ms.push_back(slowest(gather));
    reduce_scatter_ms.push_back(slowest(scatter));
  }
  network.all_reduce = fit_link_cost(sizes, all_reduce_ms);
  network.send_recv = fit_link_cost(sizes, transfer_ms);
  if (rings) {
    network.stage_transfer = fit_link_cost(sizes, ring_transfer_ms);
    network.host_memory.stage_ring_bytes = pipeline::SameHostRings::default_ring_bytes();
  }
  network.copy = fit_link_cost(sizes, copy_ms);
  network.all_gather = gathers ? fit_link_cost(sizes, all_gather_ms) : network.all_reduce;
  network.reduce_scatter = scatters ? fit_link_cost(sizes, reduce_scatter_ms) : network.all_reduce;
  // One host when every rank names the same one (the lowest and the highest hash of the names agree).
  const auto host = static_cast<int64_t>(std::hash<std::string>()(memfd_host_key()));
  std::vector<at::Tensor> lowest{at::full({1}, host, at::kLong)}, highest{at::full({1}, host, at::kLong)};
  group->allreduce(lowest, {c10d::ReduceOp::MIN})->wait();
  group->allreduce(highest, {c10d::ReduceOp::MAX})->wait();
  if (lowest[0].item<int64_t>() == highest[0].item<int64_t>()) {
    network.ps_ring_bytes = ps::Channel::default_ring_bytes();
  }
  return network;
}

ModelPassTimes measure_model_pass(const std::vector<pipeline::LayerFactory>& factories,
                                  const pipeline::Tensors& sample,
                                  const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  TORCH_CHECK(!factories.empty() && !sample.empty(), "plan: a model of at least one layer and a sample");
  std::vector<pipeline::Layer> layers;
  for (const auto& factory : factories) layers.push_back(factory());
  const auto pass = [&] {
    pipeline::Tensors current = sample;
    for (auto& layer : layers) current = layer.forward(current);
    const auto roots = requiring_grad(current);
    pipeline::Tensors seeds;
    for (const auto& root : roots) seeds.push_back(at::ones_like(root));
    if (!roots.empty()) torch::autograd::backward(roots, seeds);
    for (auto& layer : layers) {
      for (auto& parameter : layer.parameters) parameter.mutable_grad() = at::Tensor();
    }
  };
  const auto all_ranks = [&](double value, c10d::ReduceOp::RedOpType op) {
    std::vector<at::Tensor> tensor{at::full({1}, value, at::kDouble)};
    group->allreduce(tensor, {op})->wait();
    return tensor[0].item<double>();
  };
  const auto passes_ms = [&](int passes) {
    const auto start = Clock::now();
    for (int i = 0; i < passes; ++i) pass();
    return elapsed_ms(start) / passes;
  };
  // Alone and together alternate over a few rounds, each ~0.1 s, and the medians count: a shared
  // machine's slow spell then lands in one round rather than in one of the two figures.
  constexpr double kRoundMs = 100;
  constexpr int kRounds = 3;
  double passes = 0;
  if (group->getRank() == 0) {
    pass();  // allocations, lazy initialisation
    const double first = std::max(passes_ms(1), 1e-3);
    passes = std::clamp(std::ceil(kRoundMs / first), 2.0, 100.0);
  } else {
    pass();
  }
  passes = all_ranks(passes, c10d::ReduceOp::MAX);
  std::vector<double> alone, together;
  for (int round = 0; round < kRounds; ++round) {
    group->barrier()->wait();
    alone.push_back(all_ranks(group->getRank() == 0 ? passes_ms(static_cast<int>(passes)) : 0.0,
                              c10d::ReduceOp::MAX));
    together.push_back(all_ranks(passes_ms(static_cast<int>(passes)), c10d::ReduceOp::MAX));
  }
  ModelPassTimes times;
  times.alone_ms = median(alone);
  times.together_ms = median(together);
  return times;
}

} // namespace torchpar::plan
