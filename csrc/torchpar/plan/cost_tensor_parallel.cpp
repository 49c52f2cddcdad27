// Tensor parallelism's cost model: Linear layers split in column-row pairs over a tensor group.
#include <torchpar/plan/cost_terms.h>
#include <torchpar/pipeline/partition.h>

namespace torchpar::plan {

using namespace terms;

std::vector<TensorRole> tensor_parallel_roles(const ModelProfile& model) {
  std::vector<TensorRole> roles(model.layers.size(), TensorRole::Whole);
  for (size_t i = 0; i < roles.size(); ++i) {
    if (model.layers[i].out_features <= 0) continue;
    size_t next = i + 1;
    while (next < roles.size() && model.layers[next].elementwise) ++next;
    if (next < roles.size() && model.layers[next].in_features > 0) {
      roles[i] = TensorRole::Column;
      for (size_t between = i + 1; between < next; ++between) roles[between] = TensorRole::Elementwise;
      roles[next] = TensorRole::Row;
      i = next;
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
  prediction.step_ms = forward + backward + communication + averaging +
                       optimizer_ms(model, setup, parameters, configuration.world, configuration.world) +
                       calibration.per_step_ms;
  prediction.exposed_comm_ms = communication + averaging;
  auto& memory = prediction.memory;
  memory.add("parameters (this rank's split)", parameters);
  memory.add("gradients", parameters);
  if (replicas > 1) memory.add("DDP's gradient buckets (over the replicas)", parameters);
  memory.add("optimizer state", parameters * setup.optimizer_state_factor);
  memory.add("activations", static_cast<double>(all_activation_bytes(model, samples)));
  memory.add("backward's temporaries (beyond freed activations)", backward_temporaries(model, samples));
  add_host_lines(memory, network.host_memory, heap_retained(model, parameters));
  settle_memory(prediction);
  prediction.bytes_per_step =
      static_cast<int64_t>(moved + (replicas > 1 ? 2.0 * (replicas - 1) / replicas * parameters : 0.0));
  prediction.samples_per_second = static_cast<double>(setup.batch) * 1000.0 / prediction.step_ms;
  return prediction;
}

} // namespace torchpar::plan
