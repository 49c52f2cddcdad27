// DDP's cost model: compute split over the replicas, gradient buckets all-reduced as backward produces them.
#include <torchpar/plan/cost_terms.h>

namespace torchpar::plan {

using namespace terms;

Prediction predict_data_parallel(const ModelProfile& model, const NetworkProfile& idle_network,
                                 const TrainingSetup& setup, const Configuration& configuration,
                                 const Calibration& given) {
  const int world = configuration.world;
  const auto calibration = with_contention(model, given, world, world);
  const auto network = under_load(idle_network, given);
  check_divides(setup.batch, world, "ranks");
  const int64_t samples = setup.batch / world;
  const int64_t parameters = model.parameter_bytes();
  const auto caps = first_and_later_caps(static_cast<size_t>(configuration.first_bucket_bytes),
                                         static_cast<size_t>(configuration.bucket_bytes));
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
                       optimizer_ms(model, setup, static_cast<double>(parameters), world, world) +
                       calibration.per_step_ms;
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
  add_host_lines(memory, network.host_memory, heap_retained(model, whole));
  settle_memory(prediction);
  prediction.bytes_per_step = world > 1 ? 2 * (world - 1) * parameters / world : 0;  // ring all-reduce
  prediction.samples_per_second = static_cast<double>(setup.batch) * 1000.0 / prediction.step_ms;
  return prediction;
}

} // namespace torchpar::plan
