// Sharded data parallelism's cost model (ZeRO stages 1-3 of sharded/sharded_coordinator.h).
#include <torchpar/plan/cost_terms.h>
#include <torchpar/sharded/options.h>

namespace torchpar::plan {

using namespace terms;

namespace {

// Backward's fullest moment for the reduce-scatters (sharded_coordinator.cpp). When a bucket's last gradient arrives
// its hook copies the bucket's gradients into a flat input (at stages 2-3 each gradient is dropped once copied, but
// the last one lives until the hook returns), issues the reduce-scatter (its reduced piece beside it, and over Gloo
// a clone of the input), then, with more than kReductionsInFlight in flight, waits for the oldest and adds its piece
// into the shard's averaged gradient, which the first such wait makes (zero_grad drops it each step; a backward of
// few buckets makes it only as it ends, every bucket in flight). Stage 1 keeps every gradient (a line of its own).
// `step`'s buckets are in the order they go out.
struct ReductionPeak {
  double gradients = 0;
  double buffers = 0;
  bool shard_gradient = false;  // made by then
};

ReductionPeak fullest_reduction(const OverlappedStep& step, int world, int stage, double shard, bool clones_input) {
  constexpr size_t kWindow = sharded::kReductionsInFlight;
  const auto& buckets = step.bucket_bytes;
  const double in_flight_per_byte = 1.0 + 1.0 / world + (clones_input ? 1.0 : 0.0);
  const auto in_flight = [&](size_t begin, size_t end) {
    double bytes = 0;
    for (size_t i = begin; i < end; ++i) bytes += buckets[i] * in_flight_per_byte;
    return bytes;
  };
  const auto bytes = [shard](const ReductionPeak& p) {
    return p.gradients + p.buffers + (p.shard_gradient ? shard : 0.0);
  };
  ReductionPeak fullest;
  const auto consider = [&](const ReductionPeak& now) {
    if (bytes(now) > bytes(fullest)) fullest = now;
  };
  for (size_t j = 0; j < buckets.size(); ++j) {
    const bool waits = j >= kWindow;  // for the oldest, once this bucket is issued
    const size_t oldest = waits ? j - kWindow : 0;
    if (stage >= 2) {
      consider({buckets[j], buckets[j] + in_flight(oldest, j), j > kWindow});  // copying: every gradient still there
    }
    consider({stage >= 2 ? step.bucket_last_bytes[j] : 0.0, in_flight(oldest, j + 1), waits});
  }
  if (!buckets.empty() && buckets.size() <= kWindow) consider({0.0, in_flight(0, buckets.size()), true});
  return fullest;
}

} // namespace

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
  // Stage 3's units are the layers (a bucket each: a cap of one byte closes every bucket); stages 1-2 DDP's caps.
  const std::vector<size_t> caps =
      stage == 3 ? std::vector<size_t>{1}
                 : first_and_later_caps(static_cast<size_t>(configuration.first_bucket_bytes),
                                        static_cast<size_t>(configuration.bucket_bytes));
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
  prediction.step_ms = step.forward_ms + step.finish_ms + gather_ms + optimizer_ms(model, setup, shard, world, world) +
                       calibration.per_step_ms;
  // The engine (sharded/sharded_coordinator.cpp) at its fullest moment, in backward or in the optimizer's step.
  // Always: the parameters at stages 1-2 (whole, views of flat buckets); the shard's flat copy (the optimizer's
  // parameters), its averaged gradient and the optimizer's state on it; stage 1's local gradients (kept until
  // zero_grad). In backward: the buckets being reduce-scattered (stage 3: a unit each; its parameters are freed as
  // its gradients go, before the next unit is gathered — CPU ranks prefetch none), the activations and backward's
  // temporaries. In the step: the optimizer's temporaries on the shard (one flat tensor).
  const auto reduction = apart ? fullest_reduction(step, world, stage, shard, network.reduce_scatter_clones_input)
                                : ReductionPeak{};
  const double step_temporaries = optimizer_step_temporaries(setup) * shard;
  const double backward_transient = reduction.gradients + reduction.buffers + (reduction.shard_gradient ? shard : 0.0) +
                                    static_cast<double>(all_activation_bytes(model, samples)) +
                                    backward_temporaries(model, samples);
  const bool in_step = step_temporaries + shard > backward_transient;
  auto& memory = prediction.memory;
  if (stage <= 2) memory.add("parameters", parameters);
  memory.add("the shard (the optimizer's parameters)", shard);
  memory.add("optimizer state (on the shard)", shard * setup.optimizer_state_factor);
  if (stage == 1) memory.add("gradients", parameters);
  if (in_step || reduction.shard_gradient) memory.add("the shard's averaged gradient", shard);
  if (in_step) {
    memory.add("the optimizer step's temporaries (on the shard)", step_temporaries);
  } else {
    memory.add(stage == 2 ? "gradients (a bucket's, until reduce-scattered)"
                          : "gradients (the unit's, until reduce-scattered)",
               reduction.gradients);
    memory.add("reduce-scatter buffers in flight", reduction.buffers);
    memory.add("activations", static_cast<double>(all_activation_bytes(model, samples)));
    memory.add("backward's temporaries (beyond freed activations)", backward_temporaries(model, samples));
  }
  const double bucket = stage == 3 ? largest_layer : std::min(parameters, largest(step.bucket_bytes));
  if (apart) {
    memory.add("shm group's segment (the collectives)",
               static_cast<double>(shm_segment_pages(network.host_memory.shm_chunk_bytes, world, bucket)), false);
  }
  if (stage == 3) {
    // A model built whole is sharded unit by unit as it is wrapped: the whole parameters, the shard and one unit's
    // flat tensor at once, which may exceed what training holds.
    memory.add("wrapping the model built whole (beyond training's peak)",
               parameters + shard + largest_layer - static_cast<double>(memory.tensor_bytes()));
  }
  add_host_lines(memory, network.host_memory, heap_retained(model, parameters));
  settle_memory(prediction);
  // A ring reduce-scatter and all-gather (DDP's all-reduce); stage 3 gathers twice.
  prediction.bytes_per_step =
      apart ? static_cast<int64_t>((stage == 3 ? 3.0 : 2.0) * (world - 1) / world * parameters) : 0;
  prediction.samples_per_second = static_cast<double>(setup.batch) * 1000.0 / prediction.step_ms;
  return prediction;
}

} // namespace torchpar::plan
