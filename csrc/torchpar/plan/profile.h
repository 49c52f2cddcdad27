// What the planner measures: each layer of a model (times, parameter, activation and output bytes) and
// the process group's operations (α + β · bytes of all-reduce and of a transfer between two ranks).
#pragma once
#include <torchpar/pipeline/layer.h>
#include <torchpar/plan/cost_model.h>

#include <torchpar/common/c10d_fwd.h>

#include <vector>

namespace torchpar::plan {

// Builds one layer at a time (as the pipeline would), feeds it the previous layer's output starting
// from `sample` (a batch of sample.size(0) samples), and takes the median of `repeats` runs of: the
// forward, the backward of the input gradient alone, and the whole backward (the weight part is the
// difference). Activation bytes as LayerProfile::activation_bytes says. What a layer allows comes from its
// traits (pipeline::LayerTraits: the Linear layers a tensor group splits, the elementwise layers between them,
// and the first layer's embedding tables, looked up by the sample's integer tensors, as sparse rows). Also
// measures the optimizer per parameter byte into `setup` when given: Adam if its optimizer_state_factor is 2
// or more, else SGD with momentum.
ModelProfile profile_layers(const std::vector<pipeline::LayerFactory>& factories, const pipeline::Tensors& sample,
                            int repeats = 5, TrainingSetup* setup = nullptr);

// α and β of `milliseconds` ≈ α + β · bytes, least squares on the relative error (α, β clamped at 0).
LinkCost fit_link_cost(const std::vector<double>& bytes, const std::vector<double>& milliseconds);

// Collective over `group` (every rank calls it): times all-reduces, all-gathers into and reduce-scatters
// from float32 tensors of `sizes_bytes` (the slowest rank's mean of `repeats`), a ping-pong between
// ranks 0 and 1 (half its round trip; 4 x `repeats` up to 64 KiB; also through the pipeline's same-host
// rings when they connect), and a memory copy on every rank at once, and fits each. A collective the
// backend lacks costs as an all-reduce. A group of one rank costs
// nothing.
NetworkProfile measure_network(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                               const std::vector<int64_t>& sizes_bytes = {4 << 10, 64 << 10, 256 << 10, 4 << 20},
                               int repeats = 25);

// The whole model's forward and backward on `sample`, timed over ~0.1 s of passes on rank 0 alone, then on
// every rank of `group` at once (the slowest rank's time), three rounds of each, alternated (the medians);
// every rank calls it. Ranks sharing cores, or cores sharing memory bandwidth, show as `together` over
// `alone`.
struct ModelPassTimes {
  double alone_ms = 0;
  double together_ms = 0;
};
ModelPassTimes measure_model_pass(const std::vector<pipeline::LayerFactory>& factories,
                                  const pipeline::Tensors& sample,
                                  const c10::intrusive_ptr<c10d::ProcessGroup>& group);

} // namespace torchpar::plan
