#include <torchpar/plan/cost_model.h>

#include <torchpar/common/bucket_assignment.h>
#include <torchpar/pipeline/partition.h>
#include <torchpar/pipeline/simulator.h>
#include <torchpar/ps/wire_format.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

namespace torchpar::plan {
namespace {

// A layer's time at `samples` samples per pass, calibrated.
double at_samples(double profiled_ms, double overhead_ms, int64_t samples, const ModelProfile& model,
                  const Calibration& calibration) {
  const double scaled = overhead_ms + (profiled_ms - overhead_ms) * static_cast<double>(samples) /
                                          static_cast<double>(model.batch);
  return scaled * calibration.compute_scale;
}

double forward_at(const LayerProfile& layer, int64_t samples, const ModelProfile& model,
                  const Calibration& calibration) {
  return at_samples(layer.forward_ms, layer.forward_overhead_ms, samples, model, calibration);
}
double backward_input_at(const LayerProfile& layer, int64_t samples, const ModelProfile& model,
                         const Calibration& calibration) {
  return at_samples(layer.backward_input_ms, layer.backward_input_overhead_ms, samples, model, calibration);
}
double backward_weight_at(const LayerProfile& layer, int64_t samples, const ModelProfile& model,
                          const Calibration& calibration) {
  return at_samples(layer.backward_weight_ms, layer.backward_weight_overhead_ms, samples, model, calibration);
}

// The calibration with compute slowed for `busy` of the world's ranks computing at once.
Calibration with_contention(const ModelProfile& model, const Calibration& calibration, double busy, int world) {
  Calibration effective = calibration;
  const double share = world > 1 ? std::clamp((busy - 1) / (world - 1), 0.0, 1.0) : 0.0;
  effective.compute_scale *= 1 + (model.contention - 1) * share;
  return effective;
}

// The process group's operations while the ranks compute; with `busy` of the world's ranks computing, the
// load in proportion (as with_contention's compute).
NetworkProfile under_load(const NetworkProfile& network, const Calibration& calibration, double busy = 0,
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
NetworkProfile within_group(const NetworkProfile& network, int world, int group) {
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

int64_t at_samples(int64_t profiled_bytes, int64_t samples, const ModelProfile& model) {
  return profiled_bytes * samples / model.batch;
}

void check_divides(int64_t batch, int64_t parts, const std::string& what) {
  TORCH_CHECK(parts > 0 && batch % parts == 0, "batch ", batch, " does not divide into ", parts, " ", what);
}

int64_t sum_parameter_bytes(const ModelProfile& model, int64_t begin, int64_t end) {
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
};

template <typename BucketCost>
OverlappedStep overlapped_step(const ModelProfile& model, int64_t samples, const std::vector<size_t>& caps,
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
    double bytes = 0, at = 0;
    for (size_t index : bucket) {
      bytes += static_cast<double>(parameters[index].bytes);
      at = std::max(at, ready[index]);
    }
    if (bytes == 0) continue;
    step.bucket_bytes.push_back(bytes);
    bucket_ready.push_back(at);
    bucket_cost_ms.push_back(bucket_cost(bytes));
  }
  step.finish_ms = overlapped_finish_ms(bucket_ready, bucket_cost_ms, step.backward_ms, calibration.overlap);
  return step;
}

int64_t activation_bytes(const ModelProfile& model, int64_t samples, int64_t begin, int64_t end);

int64_t all_activation_bytes(const ModelProfile& model, int64_t samples) {
  return activation_bytes(model, samples, 0, static_cast<int64_t>(model.layers.size()));
}

int64_t largest_layer_parameters(const ModelProfile& model, int64_t begin = 0, int64_t end = -1) {
  int64_t largest = 0;
  if (end < 0) end = static_cast<int64_t>(model.layers.size());
  for (int64_t layer = begin; layer < end; ++layer) {
    largest = std::max(largest, model.layers[static_cast<size_t>(layer)].parameter_bytes);
  }
  return largest;
}

double largest(const std::vector<double>& values) {
  return values.empty() ? 0.0 : *std::max_element(values.begin(), values.end());
}

// What glibc keeps of the blocks a rank re-makes each step, `remade_bytes` of gradients: at least one such block's
// worth (zero_grad frees them, forward's allocations take their place, backward makes them anew higher up the heap:
// measured, DDP of a 24 MiB embedding 27 MiB above its tensors, of a 7 MiB MLP 6 MiB), or the model's own share
// where its training in one process measured more (activations re-made as well: a 0.5 MiB conv net kept 6 MiB).
double retained(const ModelProfile& model, double remade_bytes) {
  const auto whole = static_cast<double>(model.parameter_bytes());
  const double share = whole > 0 ? static_cast<double>(model.heap_retention_bytes) * std::min(1.0, remade_bytes / whole)
                                 : 0.0;
  return std::max(remade_bytes, share);
}

// What layers [begin, end)'s backward temporaries add at `samples` above the activations, which the memory line
// of the activations counts whole: backward runs from the last layer to the first, freeing each layer's
// activations as it goes, so a layer's temporaries count only beyond the activations of the layers after it.
double backward_temporaries(const ModelProfile& model, int64_t samples, int64_t begin = 0, int64_t end = -1) {
  if (end < 0) end = static_cast<int64_t>(model.layers.size());
  int64_t most = 0, freed = 0;
  for (int64_t layer = end; layer-- > begin;) {
    const auto& profile = model.layers[static_cast<size_t>(layer)];
    most = std::max(most, at_samples(profile.backward_temporary_bytes, samples, model) - freed);
    freed += at_samples(profile.activation_bytes, samples, model);
  }
  return static_cast<double>(most);
}

// memory_per_rank and tensor_memory_per_rank from the breakdown.
void settle_memory(Prediction& prediction) {
  prediction.memory_per_rank = prediction.memory.total();
  prediction.tensor_memory_per_rank = prediction.memory.tensor_bytes();
}

int64_t activation_bytes(const ModelProfile& model, int64_t samples, int64_t begin, int64_t end) {
  int64_t bytes = 0;
  for (int64_t layer = begin; layer < end; ++layer) {
    bytes += at_samples(model.layers[static_cast<size_t>(layer)].activation_bytes, samples, model);
  }
  return bytes;
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

SplitLayerCost split_layer_cost(const ModelProfile& model, size_t index, TensorRole role, int tensor, int64_t samples,
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
  const auto input = static_cast<double>(at_samples(layer.activation_bytes - layer.output_bytes, samples, model));
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

} // namespace

int64_t ModelProfile::parameter_bytes() const {
  return sum_parameter_bytes(*this, 0, static_cast<int64_t>(layers.size()));
}

double ModelProfile::compute_ms() const {
  double total = 0;
  for (const auto& layer : layers) total += layer.forward_ms + layer.backward_input_ms + layer.backward_weight_ms;
  return total;
}

ModelProfile ModelProfile::scaled_to(double pass_ms) const {
  const double total = compute_ms();
  TORCH_CHECK(total > 0 && pass_ms > 0, "plan: cannot scale a profile of ", total, " ms to ", pass_ms, " ms");
  const double factor = pass_ms / total;
  ModelProfile scaled = *this;
  for (auto& layer : scaled.layers) {
    for (double* time : {&layer.forward_ms, &layer.backward_input_ms, &layer.backward_weight_ms,
                         &layer.forward_overhead_ms, &layer.backward_input_overhead_ms,
                         &layer.backward_weight_overhead_ms}) {
      *time *= factor;
    }
  }
  return scaled;
}

namespace {

// "1 worker", "2 workers": the plan's table is read by people.
std::string count_of(int64_t count, const char* noun, const char* plural_ending = "s") {
  return std::to_string(count) + " " + noun + (count == 1 ? "" : plural_ending);
}

} // namespace

std::string Configuration::describe() const {
  std::ostringstream out;
  switch (strategy) {
    case Strategy::DataParallel:
      out << "ddp, " << count_of(world, "replica");
      break;
    case Strategy::Pipeline:
      out << "pipeline " << pipeline::schedule_name(schedule) << ", " << count_of(world / (replicas * tensor), "stage");
      if (virtual_stages > 1) out << " (x" << virtual_stages << " virtual)";
      if (tensor > 1) out << " x " << tensor << " tensor";
      if (replicas > 1) out << " x " << count_of(replicas, "replica");
      out << ", " << count_of(microbatches, "micro-batch", "es");
      break;
    case Strategy::ParameterServer:
      out << "ps " << (synchronous ? "bsp" : "asp") << ", " << count_of(world - servers, "worker") << " + "
          << count_of(servers, "server");
      break;
    case Strategy::TensorParallel:
      out << "tensor parallel over " << count_of(world / replicas, "rank");
      if (replicas > 1) out << " x " << count_of(replicas, "replica");
      break;
    case Strategy::Sharded:
      out << "sharded zero-" << zero_stage << ", " << count_of(world, "replica");
      break;
  }
  return out.str();
}

double overlapped_finish_ms(const std::vector<double>& ready_ms, const std::vector<double>& cost_ms,
                            double backward_ms, double overlap) {
  TORCH_CHECK(ready_ms.size() == cost_ms.size(), "overlapped_finish_ms: one cost per bucket");
  double overlapped = 0, serial = backward_ms;
  for (size_t bucket = 0; bucket < ready_ms.size(); ++bucket) {
    overlapped = std::max(overlapped, ready_ms[bucket]) + cost_ms[bucket];
    serial += cost_ms[bucket];
  }
  overlapped = std::max(overlapped, backward_ms);
  return serial - std::clamp(overlap, 0.0, 1.0) * (serial - overlapped);
}

Prediction predict_data_parallel(const ModelProfile& model, const NetworkProfile& idle_network,
                                 const TrainingSetup& setup, const Configuration& configuration,
                                 const Calibration& given) {
  const int world = configuration.world;
  const auto calibration = with_contention(model, given, world, world);
  const auto network = under_load(idle_network, given);
  check_divides(setup.batch, world, "ranks");
  const int64_t samples = setup.batch / world;
  const int64_t parameters = model.parameter_bytes();
  const std::vector<size_t> caps{static_cast<size_t>(configuration.first_bucket_bytes),
                                 static_cast<size_t>(configuration.bucket_bytes)};
  // Each gradient is copied into its bucket as it becomes final (on the compute thread), and the
  // averaged bucket back into the gradients once the all-reduces are done; unless averaged in place.
  const double copy_ms_per_byte = world > 1 && !network.ddp_in_place ? network.copy.ms_per_byte : 0.0;
  const auto step = overlapped_step(model, samples, caps, calibration, copy_ms_per_byte, [&](double bytes) {
    return world > 1 ? network.ddp_link().milliseconds(bytes) : 0.0;
  });
  Prediction prediction;
  prediction.configuration = configuration;
  prediction.compute_ms = step.forward_ms + step.backward_ms;
  prediction.exposed_comm_ms = step.finish_ms - step.backward_ms;
  prediction.step_ms = step.forward_ms + step.finish_ms + copy_ms_per_byte * static_cast<double>(parameters) +
                       setup.optimizer_ms_per_byte * static_cast<double>(parameters) + calibration.per_step_ms;
  // Parameters, gradients, the buckets' flat copies of them, optimizer state; activations of its samples; the
  // pages of the shm group its buckets go through.
  auto& memory = prediction.memory;
  const auto whole = static_cast<double>(parameters);
  memory.add("parameters", whole);
  memory.add("gradients", whole);
  if (world > 1) memory.add("DDP's gradient buckets", whole);
  memory.add("optimizer state", whole * setup.optimizer_state_factor);
  memory.add("activations", static_cast<double>(all_activation_bytes(model, samples)));
  if (world > 1) {
    memory.add("shm group's segment (DDP's buckets)",
               static_cast<double>(shm_segment_pages(network.host_memory.shm_chunk_bytes, world, largest(step.bucket_bytes))),
               false);
  }
  memory.add("backward's temporaries (beyond freed activations)", backward_temporaries(model, samples));
  add_host_lines(memory, network.host_memory, retained(model, whole));
  settle_memory(prediction);
  prediction.bytes_per_step = world > 1 ? 2 * (world - 1) * parameters / world : 0;  // ring all-reduce
  prediction.samples_per_second = static_cast<double>(setup.batch) * 1000.0 / prediction.step_ms;
  return prediction;
}

Prediction predict_pipeline(const ModelProfile& model, const NetworkProfile& idle_network,
                            const TrainingSetup& setup, const Configuration& configuration, const Calibration& given) {
  const int replicas = configuration.replicas;
  const int tensor = configuration.tensor;
  const auto network = under_load(idle_network, given);
  const auto replica_network = within_group(network, configuration.world, replicas);
  TORCH_CHECK(replicas > 0 && tensor > 0 && configuration.world % (replicas * tensor) == 0, replicas,
              " replicas x ", tensor, " tensor ranks do not divide ", configuration.world, " ranks");
  pipeline::ScheduleSpec spec;
  spec.kind = configuration.schedule;
  spec.ranks = configuration.world / (replicas * tensor);
  spec.microbatches = configuration.microbatches;
  spec.virtual_stages = configuration.virtual_stages;
  const int stages = spec.stages();
  const auto layers = static_cast<int64_t>(model.layers.size());
  TORCH_CHECK(layers >= stages, "the model has ", layers, " layers, fewer than the ", stages, " stages");
  check_divides(setup.batch, replicas, "replicas");
  check_divides(setup.batch / replicas, configuration.microbatches, "micro-batches");
  const int64_t micro = setup.batch / replicas / configuration.microbatches;

  std::vector<double> layer_ms;
  for (const auto& layer : model.layers) {
    layer_ms.push_back(layer.forward_ms + layer.backward_input_ms + layer.backward_weight_ms);
  }
  auto balance =
      configuration.balance.empty() ? pipeline::balanced_partition(layer_ms, stages) : configuration.balance;
  pipeline::check_partition(balance, layers, stages);
  const auto bounds = pipeline::stage_boundaries(balance);
  const auto roles = tensor > 1 ? tensor_parallel_roles(model, balance)
                                : std::vector<TensorRole>(model.layers.size(), TensorRole::Whole);
  const auto is_split = [](TensorRole role) { return role != TensorRole::Whole; };
  TORCH_CHECK(tensor == 1 || std::any_of(roles.begin(), roles.end(), is_split),
              "no layer of the model splits over a tensor group (nn.Linear layers do)");

  // Transfers and a tensor group's collectives run while the pipeline's other ranks may wait in its bubble.
  const auto loaded_with = [&](double busy) { return under_load(idle_network, given, busy, configuration.world); };
  // The stages' costs with `busy` of the world's ranks computing at once.
  const auto stage_costs = [&](double busy) {
    const auto calibration = with_contention(model, given, busy, configuration.world);
    const auto busy_network = loaded_with(busy);
    const auto tensor_network = within_group(busy_network, configuration.world, tensor);
    std::vector<pipeline::ActionCosts> costs(static_cast<size_t>(stages));
    for (int stage = 0; stage < stages; ++stage) {
      auto& cost = costs[static_cast<size_t>(stage)];
      cost.forward = cost.backward_input = cost.backward_weight = 0;
      const auto [first, end] = std::pair(bounds[static_cast<size_t>(stage)], bounds[static_cast<size_t>(stage) + 1]);
      for (int64_t layer = first; layer < end; ++layer) {
        const auto index = static_cast<size_t>(layer);
        const auto split = split_layer_cost(model, index, roles[index], tensor, micro, tensor_network, calibration);
        cost.forward += split.forward_ms + split.forward_communication_ms;
        cost.backward_input += split.backward_input_ms + split.backward_communication_ms;
        cost.backward_weight += split.backward_weight_ms;
      }
      cost.forward += calibration.per_action_ms;
      cost.backward_input += calibration.per_action_ms;
      cost.backward_weight += calibration.per_action_ms;
      cost.backward = cost.backward_input + cost.backward_weight - calibration.per_action_ms;
      // The simulator charges one transfer time per sending stage, for activations forward and gradients
      // back: the larger of the two.
      const auto boundary_bytes = [&](int64_t layer) {
        return at_samples(model.layers[static_cast<size_t>(layer)].output_bytes, micro, model);
      };
      const int64_t forward_bytes = stage + 1 < stages ? boundary_bytes(bounds[static_cast<size_t>(stage) + 1] - 1) : 0;
      const int64_t backward_bytes = stage > 0 ? boundary_bytes(bounds[static_cast<size_t>(stage)] - 1) : 0;
      const auto sent = static_cast<double>(std::max(forward_bytes, backward_bytes));
      cost.transfer = stages > 1 ? busy_network.stage_link().milliseconds(sent) + calibration.per_transfer_ms : 0.0;
    }
    return costs;
  };
  // How many ranks compute at once follows from the bubble: simulate alone, then with that many busy.
  const double alone_bubble = pipeline::simulate(spec, stage_costs(1)).bubble_fraction;
  const double busy = configuration.world * (1 - alone_bubble);
  const auto costs = stage_costs(busy);
  const auto simulation = pipeline::simulate(spec, costs);
  const auto calibration = with_contention(model, given, busy, configuration.world);
  const auto tensor_network = within_group(loaded_with(busy), configuration.world, tensor);

  Prediction prediction;
  prediction.configuration = configuration;
  prediction.balance = balance;
  prediction.bubble_fraction = simulation.bubble_fraction;
  double slowest_extra = 0;
  for (int rank = 0; rank < spec.ranks; ++rank) {
    int64_t parameters = 0, activations = 0, sent = 0, largest_message = 0;
    double compute = 0;
    std::set<int> neighbours;  // the stage ranks this one exchanges activations and gradients with
    for (int stage = rank; stage < stages; stage += spec.ranks) {
      const auto begin = bounds[static_cast<size_t>(stage)], end = bounds[static_cast<size_t>(stage) + 1];
      for (int64_t layer = begin; layer < end; ++layer) {
        const auto index = static_cast<size_t>(layer);
        const auto split = split_layer_cost(model, index, roles[index], tensor, micro, tensor_network, calibration);
        parameters += static_cast<int64_t>(split.parameter_bytes);
        sent += static_cast<int64_t>(spec.microbatches * split.moved_bytes);
      }
      activations = std::max(activations, activation_bytes(model, micro, begin, end));
      const auto& cost = costs[static_cast<size_t>(stage)];
      compute += spec.microbatches * (cost.forward + cost.backward);
      const int64_t boundary = at_samples(model.layers[static_cast<size_t>(end - 1)].output_bytes, micro, model);
      if (stage + 1 < stages) {  // activations forward
        sent += spec.microbatches * boundary;
        largest_message = std::max(largest_message, boundary);
        neighbours.insert((stage + 1) % spec.ranks);
      }
      if (stage > 0) {  // gradients back
        const auto& previous = model.layers[static_cast<size_t>(begin - 1)];
        const int64_t gradient = at_samples(previous.output_bytes, micro, model);
        sent += spec.microbatches * gradient;
        largest_message = std::max(largest_message, gradient);
        neighbours.insert((stage - 1) % spec.ranks);
      }
    }
    neighbours.erase(rank);
    const double averaging =
        replicas > 1 ? replica_network.all_reduce.milliseconds(static_cast<double>(parameters)) : 0.0;
    slowest_extra = std::max(slowest_extra, averaging + setup.optimizer_ms_per_byte * static_cast<double>(parameters));
    prediction.compute_ms = std::max(prediction.compute_ms, compute);
    MemoryBreakdown memory;
    const auto held = simulation.peak_activations[static_cast<size_t>(rank)];
    const auto whole = static_cast<double>(parameters);
    memory.add(tensor > 1 ? "parameters (this rank's split)" : "parameters", whole);
    memory.add("gradients", whole);
    if (replicas > 1) memory.add("DDP's gradient buckets (over the replicas)", whole);
    memory.add("optimizer state", whole * setup.optimizer_state_factor);
    memory.add("activations (" + std::to_string(held) + " micro-batches')", static_cast<double>(held * activations));
    // Each neighbour's two rings (this rank's to it, its to this rank), as far as the messages in flight reach.
    const auto& host = network.host_memory;
    memory.add("pipeline rings' pages", static_cast<double>(
                   2 * neighbours.size() * static_cast<size_t>(ring_pages(
                       host.stage_ring_bytes, static_cast<double>(spec.microbatches * largest_message)))),
               false);
    double temporaries = 0;
    for (int stage = rank; stage < stages; stage += spec.ranks) {
      temporaries = std::max(temporaries, backward_temporaries(model, micro, bounds[static_cast<size_t>(stage)],
                                                               bounds[static_cast<size_t>(stage) + 1]));
    }
    memory.add("backward's temporaries (beyond freed activations)", temporaries);
    add_host_lines(memory, host, retained(model, whole));
    if (memory.total() > prediction.memory.total()) prediction.memory = std::move(memory);
    const int64_t averaged = replicas > 1 ? 2 * (replicas - 1) * parameters / replicas : 0;
    prediction.bytes_per_step = std::max(prediction.bytes_per_step, sent + averaged);
  }
  settle_memory(prediction);
  prediction.step_ms = simulation.makespan + slowest_extra + calibration.per_step_ms;
  prediction.exposed_comm_ms = std::max(0.0, prediction.step_ms - prediction.compute_ms);
  prediction.samples_per_second = static_cast<double>(setup.batch) * 1000.0 / prediction.step_ms;
  return prediction;
}

Prediction predict_parameter_server(const ModelProfile& model, const NetworkProfile& idle_network,
                                    const TrainingSetup& setup, const Configuration& configuration,
                                    const Calibration& given) {
  const int servers = configuration.servers;
  const int workers = configuration.world - servers;
  const auto calibration = with_contention(model, given, workers, configuration.world);
  const auto network = under_load(idle_network, given);
  TORCH_CHECK(servers >= 1 && workers >= 1, configuration.world, " ranks cannot hold ", servers,
              " server(s) and at least one worker");
  check_divides(setup.batch, workers, "workers");
  const int64_t samples = setup.batch / workers;
  // Embedding tables live on the servers as sparse rows: a worker holds, pulls and pushes only the rows
  // its samples touch, and its backward makes gradients for those rows alone (the dense layers as before).
  ModelProfile dense = model;
  double sparse_table = 0, touched = 0;
  for (auto& layer : dense.layers) {
    if (layer.sparse_parameter_bytes <= 0) continue;
    const double rows = std::min<double>(static_cast<double>(layer.sparse_parameter_bytes),
                                         static_cast<double>(samples * layer.sparse_bytes_per_sample));
    const double kept = static_cast<double>(layer.parameter_bytes - layer.sparse_parameter_bytes) + rows;
    const double share_of_gradient = layer.parameter_bytes > 0 ? kept / static_cast<double>(layer.parameter_bytes) : 0;
    layer.backward_weight_ms *= share_of_gradient;
    layer.backward_weight_overhead_ms *= share_of_gradient;
    layer.parameter_bytes -= layer.sparse_parameter_bytes;
    sparse_table += static_cast<double>(layer.sparse_parameter_bytes);
    touched += rows;
  }
  const auto parameters = static_cast<double>(dense.parameter_bytes());
  // Payloads larger than a frame's between ranks of one host go through the channel's ring, behind a
  // fixed-size frame that still goes through Gloo, with a copy in and a copy out.
  const auto through_ring = [&](double bytes) {
    return bytes > static_cast<double>(ps::Frame::kInlineBytes) && bytes <= static_cast<double>(network.ps_ring_bytes);
  };
  const auto transfer_ms = [&](double bytes) {
    return through_ring(bytes) ? network.send_recv.milliseconds(static_cast<double>(ps::Frame::kBytes)) +
                                     2 * network.copy.ms_per_byte * bytes
                               : network.send_recv.milliseconds(bytes);
  };
  // A server's receive of `bytes` and its answer of as many.
  const auto both_ways_ms = [&](double bytes) {
    return through_ring(bytes) ? 2 * transfer_ms(bytes) : network.send_recv.milliseconds(2 * bytes);
  };
  // A bucket's round trip: the worker copies its gradients into the push, each server (answering its
  // part in parallel with the others) applies the optimizer to it and copies its values into the
  // reply, which the worker copies into its parameters (under BSP the server applies once every worker
  // pushed: the slowest worker's round trip, which the workers' symmetry makes this one).
  const auto round_trip_ms = [&](double bytes) {
    const double part = bytes / servers;
    return 2 * transfer_ms(part) + network.copy.ms_per_byte * (2 * bytes + part) +
           setup.optimizer_ms_per_byte * part + calibration.ps_ms_per_byte * bytes;
  };
  const auto step = overlapped_step(dense, samples, {static_cast<size_t>(configuration.bucket_bytes)}, calibration,
                                    0.0, round_trip_ms);
  // The touched rows: pulled before forward, their gradients pushed (and applied) after backward.
  const double rows_ms = touched > 0 ? 2 * round_trip_ms(touched) + calibration.ps_rows_ms : 0.0;
  // Each server receives every worker's push of its share and answers every pull, and applies the
  // optimizer to its share once per step (synchronous) or per push (asynchronous); and the same for the
  // rows each worker touched.
  const double share = parameters / servers;
  const double rows_share = touched / servers;
  const double server_ms =
      workers * (both_ways_ms(share) + both_ways_ms(rows_share) +
                 (network.copy.ms_per_byte + calibration.ps_ms_per_byte) * (share + rows_share)) +
      setup.optimizer_ms_per_byte * (share * (configuration.synchronous ? 1 : workers) + rows_share * workers);
  const double worker_ms = step.forward_ms + step.finish_ms + rows_ms;
  Prediction prediction;
  prediction.configuration = configuration;
  prediction.compute_ms = step.forward_ms + step.backward_ms;
  prediction.step_ms = std::max(worker_ms, server_ms) + calibration.per_step_ms + calibration.ps_per_step_ms;
  prediction.exposed_comm_ms = prediction.step_ms - prediction.compute_ms;
  // Measured (docs/planner.md): a worker holds its parameters, their gradients, the buffer the pulled
  // values land in and the replies (and of the rows it touched, the rows, their gradients and the
  // reply); a server its share, the optimizer's state, each worker's push and the round's copy of it,
  // the workers' mean, and Adam's temporaries — and its part of the tables with their state (every row
  // some batch touches, at most the whole table). Between ranks of one host both ends also map the
  // pages of both rings of each channel that the payloads in flight touched (every bucket at once, at
  // most the ring).
  const auto channel_pages = [&](double bytes) { return through_ring(bytes) ? 2 * bytes : 0.0; };
  MemoryBreakdown worker;
  worker.add("parameters", parameters);
  worker.add("gradients", parameters);
  worker.add("pulled values' buffer", parameters);
  worker.add("servers' replies", parameters);
  worker.add("sparse rows touched (rows, gradients, reply)", 3 * touched);
  worker.add("activations", static_cast<double>(all_activation_bytes(model, samples)));
  worker.add("parameter server rings' pages", servers * channel_pages((parameters + touched) / servers), false);
  worker.add("backward's temporaries (beyond freed activations)", backward_temporaries(model, samples));
  add_host_lines(worker, network.host_memory, retained(model, parameters));
  MemoryBreakdown server;
  server.add("its share of the parameters", share);
  server.add("optimizer state", share * setup.optimizer_state_factor);
  server.add("workers' pushes, kept until answered, and the round's copies", 2 * workers * share);
  if (workers > 1) server.add("the workers' mean", share);
  if (setup.optimizer_state_factor >= 2) server.add("Adam's temporaries", 2 * share);
  server.add("its part of the sparse tables, with optimizer state",
             sparse_table / servers * (1 + setup.optimizer_state_factor));
  server.add("workers' pushes of sparse rows", 2 * workers * rows_share);
  server.add("parameter server rings' pages", workers * channel_pages(share + rows_share), false);
  add_host_lines(server, network.host_memory, 0.0);  // it runs no training loop
  prediction.memory = worker.total() >= server.total() ? std::move(worker) : std::move(server);
  settle_memory(prediction);
  prediction.bytes_per_step = static_cast<int64_t>(std::max(2 * (parameters + touched),
                                                            2 * (share + rows_share) * workers));
  prediction.samples_per_second = static_cast<double>(setup.batch) * 1000.0 / prediction.step_ms;
  return prediction;
}

std::vector<TensorRole> tensor_parallel_roles(const ModelProfile& model) {
  std::vector<TensorRole> roles(model.layers.size(), TensorRole::Whole);
  for (size_t i = 0; i < roles.size(); ++i) {
    if (model.layers[i].out_features <= 0) continue;
    if (i + 1 < roles.size() && model.layers[i + 1].in_features > 0) {
      roles[i] = TensorRole::Column;
      roles[++i] = TensorRole::Row;
    } else {
      roles[i] = TensorRole::ColumnGathered;
    }
  }
  return roles;
}

std::vector<TensorRole> tensor_parallel_roles(const ModelProfile& model, const std::vector<int64_t>& balance) {
  pipeline::check_partition(balance, static_cast<int64_t>(model.layers.size()), static_cast<int>(balance.size()));
  const auto bounds = pipeline::stage_boundaries(balance);
  std::vector<TensorRole> roles;
  for (size_t stage = 0; stage + 1 < bounds.size(); ++stage) {
    ModelProfile part;
    part.layers.assign(model.layers.begin() + bounds[stage], model.layers.begin() + bounds[stage + 1]);
    const auto stage_roles = tensor_parallel_roles(part);
    roles.insert(roles.end(), stage_roles.begin(), stage_roles.end());
  }
  return roles;
}

Prediction predict_tensor_parallel(const ModelProfile& model, const NetworkProfile& idle_network,
                                   const TrainingSetup& setup, const Configuration& configuration,
                                   const Calibration& given) {
  const int replicas = configuration.replicas;
  TORCH_CHECK(replicas > 0 && configuration.world % replicas == 0, replicas, " replicas do not divide ",
              configuration.world, " ranks");
  const int tensor = configuration.world / replicas;
  TORCH_CHECK(tensor >= 2, "a tensor group needs at least 2 ranks");
  check_divides(setup.batch, replicas, "replicas");
  const auto roles = tensor_parallel_roles(model);
  TORCH_CHECK(std::any_of(roles.begin(), roles.end(), [](TensorRole role) { return role != TensorRole::Whole; }),
              "no layer of the model splits over a tensor group (nn.Linear layers do)");
  const auto calibration = with_contention(model, given, configuration.world, configuration.world);
  const auto network = under_load(idle_network, given);
  const int64_t samples = setup.batch / replicas;
  const auto tensor_network = within_group(network, configuration.world, tensor);
  double forward = 0, backward = 0, communication = 0, moved = 0, parameters = 0;
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const auto cost = split_layer_cost(model, i, roles[i], tensor, samples, tensor_network, calibration);
    forward += cost.forward_ms;
    backward += cost.backward_input_ms + cost.backward_weight_ms;
    communication += cost.forward_communication_ms + cost.backward_communication_ms;
    moved += cost.moved_bytes;
    parameters += cost.parameter_bytes;
  }
  const double averaging =
      replicas > 1 ? within_group(network, configuration.world, replicas).all_reduce.milliseconds(parameters) : 0.0;
  Prediction prediction;
  prediction.configuration = configuration;
  prediction.compute_ms = forward + backward;
  prediction.step_ms = forward + backward + communication + averaging + setup.optimizer_ms_per_byte * parameters +
                       calibration.per_step_ms;
  prediction.exposed_comm_ms = communication + averaging;
  auto& memory = prediction.memory;
  memory.add("parameters (this rank's split)", parameters);
  memory.add("gradients", parameters);
  if (replicas > 1) memory.add("DDP's gradient buckets (over the replicas)", parameters);
  memory.add("optimizer state", parameters * setup.optimizer_state_factor);
  memory.add("activations", static_cast<double>(all_activation_bytes(model, samples)));
  memory.add("backward's temporaries (beyond freed activations)", backward_temporaries(model, samples));
  add_host_lines(memory, network.host_memory, retained(model, parameters));
  settle_memory(prediction);
  prediction.bytes_per_step =
      static_cast<int64_t>(moved + (replicas > 1 ? 2.0 * (replicas - 1) / replicas * parameters : 0.0));
  prediction.samples_per_second = static_cast<double>(setup.batch) * 1000.0 / prediction.step_ms;
  return prediction;
}

Prediction predict_sharded(const ModelProfile& model, const NetworkProfile& idle_network, const TrainingSetup& setup,
                           const Configuration& configuration, const Calibration& given) {
  const int world = configuration.world;
  const int stage = configuration.zero_stage;
  TORCH_CHECK(stage >= 1 && stage <= 3, "sharded: ZeRO stage ", stage, " (1, 2 or 3)");
  const auto calibration = with_contention(model, given, world, world);
  const auto network = under_load(idle_network, given);
  check_divides(setup.batch, world, "ranks");
  const int64_t samples = setup.batch / world;
  const auto parameters = static_cast<double>(model.parameter_bytes());
  const double shard = parameters / world;
  const bool apart = world > 1;
  // Stage 3's units are the layers (a bucket each: a cap of one byte closes every bucket); stages 1-2 use DDP's.
  const std::vector<size_t> caps = stage == 3 ? std::vector<size_t>{1}
                                              : std::vector<size_t>{static_cast<size_t>(configuration.bucket_bytes)};
  // Each gradient is copied into its bucket's flat tensor as it becomes final, on the compute thread.
  const double copy_ms_per_byte = apart ? network.copy.ms_per_byte : 0.0;
  // Beside a Gloo group of one host the engine's collectives go through the same shm group as DDP's buckets
  // (sharded.md): a reduce-scatter or an all-gather is half an all-reduce there (a ring's two halves).
  LinkCost reduce_scatter = network.reduce_scatter, all_gather = network.all_gather;
  if (network.ddp_all_reduce) {
    reduce_scatter = all_gather = {network.ddp_all_reduce->alpha_ms, network.ddp_all_reduce->ms_per_byte / 2};
  }
  const auto step = overlapped_step(model, samples, caps, calibration, copy_ms_per_byte, [&](double bytes) {
    return apart ? reduce_scatter.milliseconds(bytes) : 0.0;
  });
  // The all-gathers no compute hides, of the buckets backward reduce-scattered: stages 1-2 each once after the
  // step, then the gathered values copied into the parameters; stage 3 each (a layer) before its forward and
  // again before its backward.
  double gather_ms = 0;
  if (apart) {
    for (double bytes : step.bucket_bytes) gather_ms += (stage == 3 ? 2 : 1) * all_gather.milliseconds(bytes);
    if (stage <= 2) gather_ms += network.copy.ms_per_byte * parameters;
  }
  const auto largest_layer = static_cast<double>(largest_layer_parameters(model));
  Prediction prediction;
  prediction.configuration = configuration;
  prediction.compute_ms = step.forward_ms + step.backward_ms;
  prediction.exposed_comm_ms = step.finish_ms - step.backward_ms + gather_ms;
  prediction.step_ms = step.forward_ms + step.finish_ms + gather_ms + setup.optimizer_ms_per_byte * shard +
                       calibration.per_step_ms;
  // The engine (sharded/sharded_coordinator.cpp): the parameters (stages 1-2: whole, as views of flat buckets;
  // stage 3: the unit at work, gathered — CPU ranks prefetch none); the shard's flat copy (the optimizer's
  // parameters), its averaged gradient and the optimizer's state on it; the gradients autograd makes (stage 1
  // keeps them all, stage 2 until their bucket is copied for its reduce-scatter, stage 3 the unit's); and the
  // reduce-scatters' flat copies in flight (up to three buckets, stage 3 the unit's) with their outputs.
  const double bucket = stage == 3 ? largest_layer : std::min(parameters, largest(step.bucket_bytes));
  const double in_flight = stage == 3 ? largest_layer : std::min(parameters, 3 * bucket);
  auto& memory = prediction.memory;
  memory.add(stage == 3 ? "parameters (the unit at work, gathered)" : "parameters", stage == 3 ? largest_layer : parameters);
  memory.add("the shard (the optimizer's parameters)", shard);
  memory.add("optimizer state (on the shard)", shard * setup.optimizer_state_factor);
  memory.add("the shard's averaged gradient", shard);
  memory.add(stage == 1 ? "gradients" : stage == 2 ? "gradients (a bucket's, until copied)" : "gradients (the unit's)",
             stage == 1 ? parameters : bucket);
  if (apart) memory.add("reduce-scatter buffers in flight", in_flight * (1 + 1.0 / world));
  memory.add("activations", static_cast<double>(all_activation_bytes(model, samples)));
  if (apart) {
    memory.add("shm group's segment (the collectives)",
               static_cast<double>(shm_segment_pages(network.host_memory.shm_chunk_bytes, world, bucket)), false);
  }
  memory.add("backward's temporaries (beyond freed activations)", backward_temporaries(model, samples));
  if (stage == 3) {
    // A model built whole is sharded unit by unit as it is wrapped: the whole parameters, the shard and one unit's
    // flat tensor at once, which may exceed what training holds.
    memory.add("wrapping the model built whole (beyond training's peak)",
               parameters + shard + largest_layer - static_cast<double>(memory.tensor_bytes()));
  }
  add_host_lines(memory, network.host_memory, retained(model, parameters));
  settle_memory(prediction);
  // A ring reduce-scatter and all-gather (DDP's all-reduce); stage 3 gathers twice.
  prediction.bytes_per_step =
      apart ? static_cast<int64_t>((stage == 3 ? 3.0 : 2.0) * (world - 1) / world * parameters) : 0;
  prediction.samples_per_second = static_cast<double>(setup.batch) * 1000.0 / prediction.step_ms;
  return prediction;
}

Prediction predict(const ModelProfile& model, const NetworkProfile& network, const TrainingSetup& setup,
                   const Configuration& configuration, const Calibration& calibration) {
  TORCH_CHECK(model.batch > 0 && !model.layers.empty(), "plan: the model profile has no layers");
  switch (configuration.strategy) {
    case Strategy::DataParallel: return predict_data_parallel(model, network, setup, configuration, calibration);
    case Strategy::Pipeline: return predict_pipeline(model, network, setup, configuration, calibration);
    case Strategy::ParameterServer: return predict_parameter_server(model, network, setup, configuration, calibration);
    case Strategy::TensorParallel: return predict_tensor_parallel(model, network, setup, configuration, calibration);
    case Strategy::Sharded: return predict_sharded(model, network, setup, configuration, calibration);
  }
  TORCH_CHECK(false, "plan: unknown strategy");
}

const std::vector<CalibrationKnob>& calibration_knobs() {
  static const std::vector<CalibrationKnob> knobs{
      {"compute_scale", &Calibration::compute_scale, 0.5, 4.0, 0.005, 1.0},
      {"communication_scale", &Calibration::communication_scale, 0.5, 4.0, 0.005, 1.0},
      {"overlap", &Calibration::overlap, 0.0, 1.0, 0.005, 1.0},
      {"per_action_ms", &Calibration::per_action_ms, 0.0, 2.0, 0.001, 1.0},
      {"per_transfer_ms", &Calibration::per_transfer_ms, 0.0, 2.0, 0.001, 1.0},
      {"per_step_ms", &Calibration::per_step_ms, 0.0, 5.0, 0.002, 5.0},
      {"ps_ms_per_byte", &Calibration::ps_ms_per_byte, 0.0, 2.0 / (1 << 20), 0.002 / (1 << 20), 1.0 / (1 << 20)},
      {"ps_per_step_ms", &Calibration::ps_per_step_ms, 0.0, 20.0, 0.005, 5.0},
      {"ps_rows_ms", &Calibration::ps_rows_ms, 0.0, 20.0, 0.005, 5.0}};
  return knobs;
}

Calibration fit_calibration(const std::vector<CalibrationSample>& samples, const Calibration& start) {
  TORCH_CHECK(!samples.empty(), "fit_calibration: no measured configuration to learn from");
  for (const auto& sample : samples) {
    TORCH_CHECK(sample.measured_ms > 0, "fit_calibration: ", sample.configuration.describe(), " measured ",
                sample.measured_ms, " ms");
  }
  const auto& knobs = calibration_knobs();
  // Mean squared relative error (smooth, so a compass search does not stall on a kink), plus a small
  // pull towards `start`, so that a few noisy samples do not swing knobs they barely constrain.
  const auto error = [&](const Calibration& calibration) {
    double sum = 0;
    for (const auto& sample : samples) {
      const double predicted =
          predict(sample.model, sample.network, sample.setup, sample.configuration, calibration).step_ms;
      const double relative = (predicted - sample.measured_ms) / sample.measured_ms;
      sum += relative * relative;
    }
    double pull = 0;
    for (const auto& knob : knobs) {
      const double departure = (calibration.*knob.field - start.*knob.field) / knob.unit;
      pull += 0.01 * departure * departure;
    }
    return sum / static_cast<double>(samples.size()) + pull;
  };
  Calibration best = start;
  std::vector<double> steps;
  for (const auto& knob : knobs) {
    best.*knob.field = std::clamp(best.*knob.field, knob.low, knob.high);
    steps.push_back((knob.high - knob.low) / 4);
  }
  double best_error = error(best);
  // Compass search: move one knob by its step while that helps; when no move helps, halve the steps.
  for (int iteration = 0; iteration < 2000; ++iteration) {
    bool moved = false;
    for (size_t k = 0; k < std::size(knobs) && !moved; ++k) {
      for (const double sign : {1.0, -1.0}) {
        Calibration candidate = best;
        candidate.*knobs[k].field = std::clamp(best.*knobs[k].field + sign * steps[k], knobs[k].low, knobs[k].high);
        const double candidate_error = error(candidate);
        if (candidate_error < best_error) {
          best = candidate;
          best_error = candidate_error;
          moved = true;
          break;
        }
      }
    }
    if (moved) continue;
    bool finer = false;
    for (size_t k = 0; k < std::size(knobs); ++k) {
      if (steps[k] > knobs[k].resolution) {
        steps[k] /= 2;
        finer = true;
      }
    }
    if (!finer) break;
  }
  return best;
}

} // namespace torchpar::plan
