// The terms every strategy's cost model (cost_<strategy>.cpp) is made of: a layer's time at a number of samples
// under a calibration, contention and load, a smaller group's collectives, buckets overlapping backward, a split
// layer's cost, activation and memory terms. Internal to the planner (not installed: torchpar.h does not reach it).
#pragma once
#include <torchpar/common/bucket_assignment.h>
#include <torchpar/plan/cost_model.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace torchpar::plan::terms {

// A layer's time at `samples` samples per pass, calibrated.
inline double at_samples(double profiled_ms, double overhead_ms, int64_t samples, const ModelProfile& model,
                         const Calibration& calibration) {
  const double scaled = overhead_ms + (profiled_ms - overhead_ms) * static_cast<double>(samples) /
                                          static_cast<double>(model.batch);
  return scaled * calibration.compute_scale;
}

inline double forward_at(const LayerProfile& layer, int64_t samples, const ModelProfile& model,
                         const Calibration& calibration) {
  return at_samples(layer.forward_ms, layer.forward_overhead_ms, samples, model, calibration);
}
inline double backward_input_at(const LayerProfile& layer, int64_t samples, const ModelProfile& model,
                                const Calibration& calibration) {
  return at_samples(layer.backward_input_ms, layer.backward_input_overhead_ms, samples, model, calibration);
}
inline double backward_weight_at(const LayerProfile& layer, int64_t samples, const ModelProfile& model,
                                 const Calibration& calibration) {
  return at_samples(layer.backward_weight_ms, layer.backward_weight_overhead_ms, samples, model, calibration);
}

// How much slower a rank computes with `busy` of the world's ranks computing at once (the profile's contention, in
// proportion to the ranks busy beside this one).
inline double contention_at(const ModelProfile& model, double busy, int world) {
  const double share = world > 1 ? std::clamp((busy - 1) / (world - 1), 0.0, 1.0) : 0.0;
  return 1 + (model.contention - 1) * share;
}

// The calibration with compute slowed for `busy` of the world's ranks computing at once.
inline Calibration with_contention(const ModelProfile& model, const Calibration& calibration, double busy, int world) {
  Calibration effective = calibration;
  effective.compute_scale *= contention_at(model, busy, world);
  return effective;
}

// The optimizer's step over `bytes` of parameters with `busy` of the world's ranks stepping or computing at once:
// measured in one process, and slowed by sharing cores and memory bandwidth as the layers are (2 ranks stepping a
// 24 MiB SGD with momentum at once here: 1.1-1.2x alone; 4 ranks on the 2 cores: 2-2.8x).
inline double optimizer_ms(const ModelProfile& model, const TrainingSetup& setup, double bytes, double busy,
                           int world) {
  return setup.optimizer_ms_per_byte * bytes * contention_at(model, busy, world);
}

// The process group's operations while the ranks compute; with `busy` of the world's ranks computing, the
// load in proportion (as with_contention's compute).
inline NetworkProfile under_load(const NetworkProfile& network, const Calibration& calibration, double busy = 0,
                                 int world = 0) {
  const double share = world > 1 ? std::clamp((busy - 1) / (world - 1), 0.0, 1.0) : 1.0;
  const double scale = 1 + (calibration.communication_scale - 1) * share;
  NetworkProfile loaded = network;
  const auto slow = [scale](LinkCost& link) {
    link.alpha_ms *= scale;
    link.ms_per_byte *= scale;
  };
  for (LinkCost* link : {&loaded.all_reduce, &loaded.send_recv, &loaded.all_gather, &loaded.reduce_scatter}) slow(*link);
  if (loaded.stage_transfer) slow(*loaded.stage_transfer);
  if (loaded.ddp_all_reduce) slow(*loaded.ddp_all_reduce);
  return loaded;
}

// The collectives of a group of `group` of the world's ranks, from those measured over the whole world:
// a ring's hops ((n - 1) for n ranks) scale the latency, the share of the bytes each rank sends
// ((n - 1) / n) the per-byte cost.
inline NetworkProfile within_group(const NetworkProfile& network, int world, int group) {
  if (group == world || world < 2) return network;
  NetworkProfile scaled = network;
  const double hops = static_cast<double>(group - 1) / (world - 1);
  const double bytes = (static_cast<double>(group - 1) / group) / (static_cast<double>(world - 1) / world);
  for (LinkCost* link : {&scaled.all_reduce, &scaled.all_gather, &scaled.reduce_scatter}) {
    link->alpha_ms *= hops;
    link->ms_per_byte *= bytes;
  }
  return scaled;
}

inline int64_t at_samples(int64_t profiled_bytes, int64_t samples, const ModelProfile& model) {
  return profiled_bytes * samples / model.batch;
}

inline void check_divides(int64_t batch, int64_t parts, const std::string& what) {
  TORCH_CHECK(parts > 0 && batch % parts == 0, "batch ", batch, " does not divide into ", parts, " ", what);
}

inline int64_t sum_parameter_bytes(const ModelProfile& model, int64_t begin, int64_t end) {
  int64_t bytes = 0;
  for (int64_t layer = begin; layer < end; ++layer) bytes += model.layers[static_cast<size_t>(layer)].parameter_bytes;
  return bytes;
}

// Forward, then backward with gradient buckets (DDP's all-reduces, or a worker's push-and-pull to
// the servers) going out as their gradients become final. `bucket_cost(bytes)` is one bucket's time;
// `hook_ms_per_byte` is what the compute thread spends per gradient byte as it becomes final (DDP
// copies it into its bucket).
struct OverlappedStep {
  double forward_ms = 0;
  double backward_ms = 0;
  double finish_ms = 0;  // backward end or the last bucket's end, whichever is later (after forward)
  std::vector<double> bucket_bytes;  // each non-empty bucket's, in the order they go out
  std::vector<double> bucket_last_bytes;  // each one's layer whose gradients come last (its hook sends the bucket)
};

template <typename BucketCost>
inline OverlappedStep overlapped_step(const ModelProfile& model, int64_t samples, const std::vector<size_t>& caps,
                                      const Calibration& calibration, double hook_ms_per_byte, BucketCost bucket_cost) {
  OverlappedStep step;
  const size_t layers = model.layers.size();
  std::vector<double> ready(layers);  // backward runs from the last layer to the first
  double clock = 0;
  for (size_t i = layers; i-- > 0;) {
    const auto& layer = model.layers[i];
    step.forward_ms += forward_at(layer, samples, model, calibration);
    clock += backward_input_at(layer, samples, model, calibration) +
             backward_weight_at(layer, samples, model, calibration) +
             hook_ms_per_byte * static_cast<double>(layer.parameter_bytes);
    ready[i] = clock;
  }
  step.backward_ms = clock;
  std::vector<BucketableParameter> parameters;
  for (const auto& layer : model.layers) parameters.push_back({static_cast<size_t>(layer.parameter_bytes)});
  std::vector<double> bucket_ready, bucket_cost_ms;
  for (const auto& bucket : assign_buckets(parameters, reverse_registration_order(layers), caps)) {
    double bytes = 0, at = 0, last = 0;
    for (size_t index : bucket) {
      bytes += static_cast<double>(parameters[index].bytes);
      if (ready[index] >= at && parameters[index].bytes > 0) last = static_cast<double>(parameters[index].bytes);
      at = std::max(at, ready[index]);
    }
    if (bytes == 0) continue;
    step.bucket_bytes.push_back(bytes);
    step.bucket_last_bytes.push_back(last);
    bucket_ready.push_back(at);
    bucket_cost_ms.push_back(bucket_cost(bytes));
  }
  step.finish_ms = overlapped_finish_ms(bucket_ready, bucket_cost_ms, step.backward_ms, calibration.overlap);
  return step;
}

// What layers [begin, end) hold from forward to backward at `samples`: their input and what their forwards leave.
inline int64_t activation_bytes(const ModelProfile& model, int64_t samples, int64_t begin, int64_t end) {
  if (begin >= end) return 0;
  int64_t bytes = at_samples(model.layers[static_cast<size_t>(begin)].input_bytes, samples, model);
  for (int64_t layer = begin; layer < end; ++layer) {
    bytes += at_samples(model.layers[static_cast<size_t>(layer)].activation_bytes, samples, model);
  }
  return bytes;
}

inline int64_t all_activation_bytes(const ModelProfile& model, int64_t samples) {
  return activation_bytes(model, samples, 0, static_cast<int64_t>(model.layers.size()));
}

inline int64_t largest_layer_parameters(const ModelProfile& model, int64_t begin = 0, int64_t end = -1) {
  int64_t largest = 0;
  if (end < 0) end = static_cast<int64_t>(model.layers.size());
  for (int64_t layer = begin; layer < end; ++layer) {
    largest = std::max(largest, model.layers[static_cast<size_t>(layer)].parameter_bytes);
  }
  return largest;
}

inline double largest(const std::vector<double>& values) {
  return values.empty() ? 0.0 : *std::max_element(values.begin(), values.end());
}

// What the heap keeps beyond a rank's tensors, which re-makes `remade_bytes` of the model's gradients each step:
// the share of what the model's training in one process kept (ModelProfile::heap_retention_bytes). Tensor blocks
// of 128 KiB and more come from torchpar's block cache, whose pages follow the tensors' peak (common/
// cpu_block_cache.h); what remains is the heap's small blocks and the pages the cache rounds up to.
inline double heap_retained(const ModelProfile& model, double remade_bytes) {
  const auto whole = static_cast<double>(model.parameter_bytes());
  return whole > 0 ? static_cast<double>(model.heap_retention_bytes) * std::min(1.0, remade_bytes / whole) : 0.0;
}

// What layers [begin, end)'s backward adds at `samples` above the activations, which the memory line of the
// activations counts whole. A layer's temporaries are measured on it alone (profile.cpp), which is what it adds
// inside a chain of layers; a pipeline stage's last layer (where the model goes on after it) holds besides the
// gradient that arrived from the next stage, which the pipeline keeps through the stage's backward, and the one it
// makes for its input (measured: the conv net's stages, 2026-12-07). Backward runs from the last layer to the
// first, freeing each layer's activations as it goes, so this counts only beyond the activations of the layers
// after it.
inline double backward_temporaries(const ModelProfile& model, int64_t samples, int64_t begin = 0, int64_t end = -1) {
  const auto layers = static_cast<int64_t>(model.layers.size());
  if (end < 0) end = layers;
  if (begin >= end) return 0.0;
  const auto& last = model.layers[static_cast<size_t>(end - 1)];
  const int64_t received = end < layers ? last.output_bytes : 0;
  int64_t most = 0, freed = 0;
  for (int64_t layer = end; layer-- > begin;) {
    const auto& profile = model.layers[static_cast<size_t>(layer)];
    const int64_t made = layer == end - 1 && end < layers ? profile.input_bytes : 0;
    most = std::max(most, at_samples(profile.backward_temporary_bytes + received + made, samples, model) - freed);
    freed += at_samples(profile.activation_bytes, samples, model);
  }
  return static_cast<double>(most);
}

// The temporaries an optimizer step makes per byte of the tensor it steps at once (profile.h's convention: Adam
// where its state is 2 bytes per parameter byte or more, else SGD with momentum): Adam's denominator is the square
// root of its second moment, then divided by the bias correction (two tensors alive at once); SGD's update is in
// place. torch.optim's single-tensor Adam (CPU's default) and LibTorch's make the same.
inline double optimizer_step_temporaries(const TrainingSetup& setup) {
  return setup.optimizer_state_factor >= 2 ? 2.0 : 0.0;
}

// memory_per_rank and tensor_memory_per_rank from the breakdown.
inline void settle_memory(Prediction& prediction) {
  prediction.memory_per_rank = prediction.memory.total();
  prediction.tensor_memory_per_rank = prediction.memory.tensor_bytes();
}

// One layer's work on a rank of a tensor group of `tensor` ranks, and the group's collectives it adds:
// a row-parallel layer sums its output over the group, a gathered column one gathers it, and a column
// one sums its input's gradient in backward (but the model's input needs none).
struct SplitLayerCost {
  double forward_ms = 0;
  double backward_input_ms = 0;
  double backward_weight_ms = 0;
  double forward_communication_ms = 0;
  double backward_communication_ms = 0;
  double parameter_bytes = 0;
  double moved_bytes = 0;  // sent by one rank of the group
};

inline SplitLayerCost split_layer_cost(const ModelProfile& model, size_t index, TensorRole role, int tensor, int64_t samples,
                                       const NetworkProfile& network, const Calibration& calibration) {
  const auto& layer = model.layers[index];
  if (tensor > 1 && (role == TensorRole::Column || role == TensorRole::ColumnGathered)) {
    TORCH_CHECK(layer.out_features % tensor == 0, "layer ", index, " (", layer.name, "): ", layer.out_features,
                " output features do not split over ", tensor, " ranks");
  }
  if (tensor > 1 && role == TensorRole::Row) {
    TORCH_CHECK(layer.in_features % tensor == 0, "layer ", index, " (", layer.name, "): ", layer.in_features,
                " input features do not split over ", tensor, " ranks");
  }
  const double share = role == TensorRole::Whole ? 1.0 : 1.0 / tensor;
  SplitLayerCost cost;
  cost.forward_ms = share * forward_at(layer, samples, model, calibration);
  cost.backward_input_ms = share * backward_input_at(layer, samples, model, calibration);
  cost.backward_weight_ms = share * backward_weight_at(layer, samples, model, calibration);
  cost.parameter_bytes = share * static_cast<double>(layer.parameter_bytes);
  if (tensor == 1) return cost;
  const double ring = 2.0 * (tensor - 1) / tensor;  // bytes an all-reduce sends per byte
  const auto output = static_cast<double>(at_samples(layer.output_bytes, samples, model));
  const auto input = static_cast<double>(at_samples(layer.input_bytes, samples, model));
  if (role == TensorRole::Row) {
    cost.forward_communication_ms += network.all_reduce.milliseconds(output);
    cost.moved_bytes += ring * output;
  }
  if (role == TensorRole::ColumnGathered) {
    cost.forward_communication_ms += network.all_gather.milliseconds(output);
    cost.moved_bytes += ring / 2 * output;
  }
  if ((role == TensorRole::Column || role == TensorRole::ColumnGathered) && index > 0) {
    cost.backward_communication_ms += network.all_reduce.milliseconds(input);
    cost.moved_bytes += ring * input;
  }
  return cost;
}

} // namespace torchpar::plan::terms
