// The cost model's shared parts: the profile's scaling, configurations' names, buckets overlapping backward, the
// dispatch to each strategy's model (cost_<strategy>.cpp, made of cost_terms.h) and the calibration's fit.
#include <torchpar/plan/cost_model.h>
#include <torchpar/plan/cost_terms.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <sstream>

namespace torchpar::plan {

int64_t ModelProfile::parameter_bytes() const {
  return terms::sum_parameter_bytes(*this, 0, static_cast<int64_t>(layers.size()));
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
