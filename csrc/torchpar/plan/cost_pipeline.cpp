// The pipeline's cost model: the schedule simulated over the stages' costs, per rank's memory and traffic.
#include <torchpar/plan/cost_terms.h>
#include <torchpar/pipeline/partition.h>
#include <torchpar/pipeline/simulator.h>

#include <set>

namespace torchpar::plan {

using namespace terms;

namespace {

// Most micro-batches a rank's stage `stage` holds between their input gradients (I) and their weight gradients (W)
// in the simulated timeline: the pipeline keeps each layer's output gradient until W (pipeline/stage.cpp).
int most_awaiting_weights(const pipeline::Simulation& simulation, int rank, int stage) {
  int awaiting = 0, most = 0;
  for (const auto& timed : simulation.timeline[static_cast<size_t>(rank)]) {
    if (timed.action.stage != stage) continue;
    if (timed.action.type == pipeline::ActionType::BackwardInput) most = std::max(most, ++awaiting);
    if (timed.action.type == pipeline::ActionType::BackwardWeight) --awaiting;
  }
  return most;
}

} // namespace

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
    int64_t parameters = 0, activations = 0, sent = 0, largest_message = 0, awaiting_weights = 0;
    double largest_gradient_apart = 0;  // of this rank's split: a weight gradient made apart, then accumulated
    double compute = 0, temporaries = 0;
    std::set<int> neighbours;  // the stage ranks this one exchanges activations and gradients with
    for (int stage = rank; stage < stages; stage += spec.ranks) {
      const auto begin = bounds[static_cast<size_t>(stage)], end = bounds[static_cast<size_t>(stage) + 1];
      for (int64_t layer = begin; layer < end; ++layer) {
        const auto index = static_cast<size_t>(layer);
        const auto split = split_layer_cost(model, index, roles[index], tensor, micro, tensor_network, calibration);
        parameters += static_cast<int64_t>(split.parameter_bytes);
        // A whole layer that accumulates its weight gradient itself makes none apart (split layers are others).
        if (!(model.layers[index].accumulates_weight_gradient && roles[index] == TensorRole::Whole)) {
          largest_gradient_apart = std::max(largest_gradient_apart, split.parameter_bytes);
        }
        sent += static_cast<int64_t>(spec.microbatches * split.moved_bytes);
      }
      activations = std::max(activations, activation_bytes(model, micro, begin, end));
      temporaries = std::max(temporaries, backward_temporaries(model, micro, begin, end));
      int64_t output_gradients = 0;
      for (int64_t layer = begin; layer < end; ++layer) {
        output_gradients += at_samples(model.layers[static_cast<size_t>(layer)].output_bytes, micro, model);
      }
      awaiting_weights += most_awaiting_weights(simulation, rank, stage) * output_gradients;
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
    slowest_extra = std::max(slowest_extra, averaging + optimizer_ms(model, setup, static_cast<double>(parameters),
                                                                       configuration.world, configuration.world));
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
    memory.add("backward's temporaries (beyond freed activations)", temporaries);
    memory.add("output gradients kept for the weight gradients (W)", static_cast<double>(awaiting_weights));
    // From the second micro-batch on, a layer's weight gradients are made apart and then added to those accumulated
    // (autograd's AccumulateGrad), except where the layer adds them in itself (a plain Linear's: linear_layer.h).
    if (spec.microbatches > 1) memory.add("a layer's gradients before they are accumulated", largest_gradient_apart);
    add_host_lines(memory, host, heap_retained(model, whole));
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

} // namespace torchpar::plan
