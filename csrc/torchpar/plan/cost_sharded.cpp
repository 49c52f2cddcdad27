// Sharded data parallelism's cost model (ZeRO stages 1-3 of sharded/sharded_coordinator.h).
#include <torchpar/plan/cost_terms.h>

namespace torchpar::plan {

using namespace terms;

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

} // namespace torchpar::plan
