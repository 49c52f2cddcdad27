#include <torchpar/plan/cost_model.h>

#include <torchpar/common/bucket_assignment.h>
#include <torchpar/pipeline/partition.h>
#include <torchpar/pipeline/simulator.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
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
// the servers) going out as their gradients become final. `bucket_cost(bytes)` is one bucket's time.
struct OverlappedStep {
  double forward_ms = 0;
  double backward_ms = 0;
  double finish_ms = 0;  // backward end or the last bucket's end, whichever is later (after forward)
};

template <typename BucketCost>
OverlappedStep overlapped_step(const ModelProfile& model, int64_t samples, const std::vector<size_t>& caps,
                               const Calibration& calibration, BucketCost bucket_cost) {
  OverlappedStep step;
  const size_t layers = model.layers.size();
  std::vector<double> ready(layers);  // backward runs from the last layer to the first
  double clock = 0;
  for (size_t i = layers; i-- > 0;) {
    const auto& layer = model.layers[i];
    step.forward_ms += forward_at(layer, samples, model, calibration);
    clock += backward_input_at(layer, samples, model, calibration) +
             backward_weight_at(layer, samples, model, calibration);
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
    bucket_ready.push_back(at);
    bucket_cost_ms.push_back(bucket_cost(bytes));
  }
  step.finish_ms = std::max(step.backward_ms, overlapped_finish_ms(bucket_ready, bucket_cost_ms));
  return step;
}

int64_t activation_bytes(const ModelProfile& model, int64_t samples, int64_t begin, int64_t end) {
  int64_t bytes = 0;
  for (int64_t layer = begin; layer < end; ++layer) {
    bytes += at_samples(model.layers[static_cast<size_t>(layer)].activation_bytes, samples, model);
  }
  return bytes;
}

} // namespace

int64_t ModelProfile::parameter_bytes() const {
  return sum_parameter_bytes(*this, 0, static_cast<int64_t>(layers.size()));
}

std::string Configuration::describe() const {
  std::ostringstream out;
  switch (strategy) {
    case Strategy::DataParallel:
      out << "ddp, " << world << " replicas";
      break;
    case Strategy::Pipeline:
      out << "pipeline " << pipeline::schedule_name(schedule) << ", " << world / replicas << " stages";
      if (virtual_stages > 1) out << " (x" << virtual_stages << " virtual)";
      if (replicas > 1) out << " x " << replicas << " replicas";
      out << ", " << microbatches << " micro-batches";
      break;
    case Strategy::ParameterServer:
      out << "ps " << (synchronous ? "bsp" : "asp") << ", " << world - servers << " workers + " << servers
          << (servers == 1 ? " server" : " servers");
      break;
  }
  return out.str();
}

double overlapped_finish_ms(const std::vector<double>& ready_ms, const std::vector<double>& cost_ms) {
  TORCH_CHECK(ready_ms.size() == cost_ms.size(), "overlapped_finish_ms: one cost per bucket");
  double end = 0;
  for (size_t bucket = 0; bucket < ready_ms.size(); ++bucket) end = std::max(end, ready_ms[bucket]) + cost_ms[bucket];
  return end;
}

Prediction predict_data_parallel(const ModelProfile& model, const NetworkProfile& network, const TrainingSetup& setup,
                                 const Configuration& configuration, const Calibration& calibration) {
  const int world = configuration.world;
  check_divides(setup.batch, world, "ranks");
  const int64_t samples = setup.batch / world;
  const int64_t parameters = model.parameter_bytes();
  const std::vector<size_t> caps{static_cast<size_t>(configuration.first_bucket_bytes),
                                 static_cast<size_t>(configuration.bucket_bytes)};
  const auto step = overlapped_step(model, samples, caps, calibration, [&](double bytes) {
    return world > 1 ? network.all_reduce.milliseconds(bytes) : 0.0;
  });
  Prediction prediction;
  prediction.configuration = configuration;
  prediction.compute_ms = step.forward_ms + step.backward_ms;
  prediction.exposed_comm_ms = step.finish_ms - step.backward_ms;
  prediction.step_ms = step.forward_ms + step.finish_ms +
                       setup.optimizer_ms_per_byte * static_cast<double>(parameters) + calibration.per_step_ms;
  // Parameters, gradients, the buckets' flat copies of them, optimizer state; activations of its samples.
  prediction.memory_per_rank = static_cast<int64_t>(static_cast<double>(parameters) *
                                                    (2 + (world > 1) + setup.optimizer_state_factor)) +
                               activation_bytes(model, samples, 0, static_cast<int64_t>(model.layers.size()));
  prediction.bytes_per_step = world > 1 ? 2 * (world - 1) * parameters / world : 0;  // ring all-reduce
  prediction.samples_per_second = static_cast<double>(setup.batch) * 1000.0 / prediction.step_ms;
  return prediction;
}

Prediction predict_pipeline(const ModelProfile& model, const NetworkProfile& network, const TrainingSetup& setup,
                            const Configuration& configuration, const Calibration& calibration) {
  const int replicas = configuration.replicas;
  TORCH_CHECK(replicas > 0 && configuration.world % replicas == 0, replicas, " replicas do not divide ",
              configuration.world, " ranks");
  pipeline::ScheduleSpec spec;
  spec.kind = configuration.schedule;
  spec.ranks = configuration.world / replicas;
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

  std::vector<pipeline::ActionCosts> costs(static_cast<size_t>(stages));
  for (int stage = 0; stage < stages; ++stage) {
    auto& cost = costs[static_cast<size_t>(stage)];
    cost.forward = cost.backward_input = cost.backward_weight = 0;
    const auto [first, end] = std::pair(bounds[static_cast<size_t>(stage)], bounds[static_cast<size_t>(stage) + 1]);
    for (int64_t layer = first; layer < end; ++layer) {
      const auto& profile = model.layers[static_cast<size_t>(layer)];
      cost.forward += forward_at(profile, micro, model, calibration);
      cost.backward_input += backward_input_at(profile, micro, model, calibration);
      cost.backward_weight += backward_weight_at(profile, micro, model, calibration);
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
    cost.transfer = stages > 1 ? network.send_recv.milliseconds(sent) + calibration.per_transfer_ms : 0.0;
  }
  const auto simulation = pipeline::simulate(spec, costs);

  Prediction prediction;
  prediction.configuration = configuration;
  prediction.balance = balance;
  prediction.bubble_fraction = simulation.bubble_fraction;
  double slowest_extra = 0;
  for (int rank = 0; rank < spec.ranks; ++rank) {
    int64_t parameters = 0, activations = 0, sent = 0;
    double compute = 0;
    for (int stage = rank; stage < stages; stage += spec.ranks) {
      const auto begin = bounds[static_cast<size_t>(stage)], end = bounds[static_cast<size_t>(stage) + 1];
      parameters += sum_parameter_bytes(model, begin, end);
      activations = std::max(activations, activation_bytes(model, micro, begin, end));
      const auto& cost = costs[static_cast<size_t>(stage)];
      compute += spec.microbatches * (cost.forward + cost.backward);
      const int64_t boundary = at_samples(model.layers[static_cast<size_t>(end - 1)].output_bytes, micro, model);
      if (stage + 1 < stages) sent += spec.microbatches * boundary;  // activations forward
      if (stage > 0) {                                                 // gradients back
        const auto& previous = model.layers[static_cast<size_t>(begin - 1)];
        sent += spec.microbatches * at_samples(previous.output_bytes, micro, model);
      }
    }
    const double averaging = replicas > 1 ? network.all_reduce.milliseconds(static_cast<double>(parameters)) : 0.0;
    slowest_extra = std::max(slowest_extra, averaging + setup.optimizer_ms_per_byte * static_cast<double>(parameters));
    prediction.compute_ms = std::max(prediction.compute_ms, compute);
    const int64_t memory =
        static_cast<int64_t>(static_cast<double>(parameters) * (2 + (replicas > 1) + setup.optimizer_state_factor)) +
        simulation.peak_activations[static_cast<size_t>(rank)] * activations;
    prediction.memory_per_rank = std::max(prediction.memory_per_rank, memory);
    const int64_t averaged = replicas > 1 ? 2 * (replicas - 1) * parameters / replicas : 0;
    prediction.bytes_per_step = std::max(prediction.bytes_per_step, sent + averaged);
  }
  prediction.step_ms = simulation.makespan + slowest_extra + calibration.per_step_ms;
  prediction.exposed_comm_ms = std::max(0.0, prediction.step_ms - prediction.compute_ms);
  prediction.samples_per_second = static_cast<double>(setup.batch) * 1000.0 / prediction.step_ms;
  return prediction;
}

Prediction predict_parameter_server(const ModelProfile& model, const NetworkProfile& network,
                                    const TrainingSetup& setup, const Configuration& configuration,
                                    const Calibration& calibration) {
  const int servers = configuration.servers;
  const int workers = configuration.world - servers;
  TORCH_CHECK(servers >= 1 && workers >= 1, configuration.world, " ranks cannot hold ", servers,
              " server(s) and at least one worker");
  check_divides(setup.batch, workers, "workers");
  const int64_t samples = setup.batch / workers;
  const auto parameters = static_cast<double>(model.parameter_bytes());
  // A bucket's push and the pull of its new values: the worker copies both ways; each server's part is
  // one message, the servers answering in parallel.
  const auto step = overlapped_step(model, samples, {static_cast<size_t>(configuration.bucket_bytes)}, calibration,
                                    [&](double bytes) {
                                      return 2 * (network.send_recv.alpha_ms + network.send_recv.ms_per_byte * bytes);
                                    });
  // Each server receives every worker's push of its share and answers every pull, and applies the
  // optimizer to its share once per step (synchronous) or per push (asynchronous).
  const double share = parameters / servers;
  const double server_ms = workers * network.send_recv.milliseconds(2 * share) +
                           setup.optimizer_ms_per_byte * share * (configuration.synchronous ? 1 : workers);
  const double worker_ms = step.forward_ms + step.finish_ms;
  Prediction prediction;
  prediction.configuration = configuration;
  prediction.compute_ms = step.forward_ms + step.backward_ms;
  prediction.step_ms = std::max(worker_ms, server_ms) + calibration.per_step_ms;
  prediction.exposed_comm_ms = prediction.step_ms - prediction.compute_ms;
  const auto worker_memory = static_cast<int64_t>(2 * parameters) +
                             activation_bytes(model, samples, 0, static_cast<int64_t>(model.layers.size()));
  const auto server_memory = static_cast<int64_t>(share * (1 + setup.optimizer_state_factor));
  prediction.memory_per_rank = std::max(worker_memory, server_memory);
  prediction.bytes_per_step = static_cast<int64_t>(std::max(2 * parameters, 2 * share * workers));
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
  }
  TORCH_CHECK(false, "plan: unknown strategy");
}

Calibration fit_calibration(const ModelProfile& model, const NetworkProfile& network, const TrainingSetup& setup,
                            const std::vector<Configuration>& configurations, const std::vector<double>& measured_ms) {
  TORCH_CHECK(configurations.size() == measured_ms.size() && !measured_ms.empty(),
              "fit_calibration: one measurement per configuration");
  const auto error = [&](const Calibration& calibration) {
    double sum = 0;
    for (size_t i = 0; i < configurations.size(); ++i) {
      sum += std::abs(predict(model, network, setup, configurations[i], calibration).step_ms - measured_ms[i]) /
             measured_ms[i];
    }
    return sum / static_cast<double>(measured_ms.size());
  };
  struct Knob {
    double Calibration::*field;
    double low, high, step;
  };
  const Knob knobs[] = {{&Calibration::compute_scale, 0.5, 4.0, 0.05},
                        {&Calibration::per_action_ms, 0.0, 2.0, 0.01},
                        {&Calibration::per_transfer_ms, 0.0, 2.0, 0.01},
                        {&Calibration::per_step_ms, 0.0, 5.0, 0.02}};
  Calibration best;
  double best_error = error(best);
  for (int round = 0; round < 4; ++round) {  // each knob in turn, with the others where they are
    for (const auto& knob : knobs) {
      for (double value = knob.low; value <= knob.high + 1e-9; value += knob.step) {
        Calibration candidate = best;
        candidate.*knob.field = value;
        const double candidate_error = error(candidate);
        if (candidate_error < best_error) {
          best = candidate;
          best_error = candidate_error;
        }
      }
    }
  }
  return best;
}

} // namespace torchpar::plan
