// The planner's cost model: from a model's per-layer profile and the measured cost of the process
// group's operations, the predicted step time and memory per rank of each strategy. Pure functions (no
// process group, no tensors), tested against hand-computed cases.
//
// Times are in milliseconds; a layer's times are measured at the profile's batch and at a smaller one,
// and scale linearly with the samples a rank computes per pass above a fixed overhead per pass.
#pragma once
#include <torchpar/pipeline/schedules.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torchpar::plan {

struct LayerProfile {
  std::string name;
  double forward_ms = 0;          // at ModelProfile::batch samples
  double backward_input_ms = 0;   // the input gradient's part of backward
  double backward_weight_ms = 0;  // the weight gradients' part
  int64_t parameter_bytes = 0;
  int64_t activation_bytes = 0;   // kept for backward, at ModelProfile::batch samples
  int64_t output_bytes = 0;       // what a stage boundary after this layer sends, at ModelProfile::batch
  // The part of each time that does not shrink with fewer samples (kernel launches, Python,
  // allocation): a pass over n samples takes overhead + (time - overhead) * n / batch.
  double forward_overhead_ms = 0;
  double backward_input_overhead_ms = 0;
  double backward_weight_overhead_ms = 0;
};

struct ModelProfile {
  int64_t batch = 1;  // the samples the layers were profiled with
  std::vector<LayerProfile> layers;
  int64_t parameter_bytes() const;
};

// A collective's or transfer's cost, α + β · bytes, fitted from measurements (see network_profile).
struct LinkCost {
  double alpha_ms = 0;
  double ms_per_byte = 0;
  double milliseconds(double bytes) const { return bytes > 0 ? alpha_ms + ms_per_byte * bytes : 0; }
};

// The process group's operations, measured over all of its ranks (send_recv: between two of them).
struct NetworkProfile {
  LinkCost all_reduce;
  LinkCost send_recv;
};

// What the model learns from measured runs (plan --verify), applied to every prediction:
//   compute_scale       measured compute / profiled compute when all ranks compute at once (ranks
//                       sharing cores or memory bandwidth slow each other)
//   per_action_ms       host work per pipeline compute action (F, B, I, W) that the layers' own
//                       times do not hold: the schedule's bookkeeping, the loss call, gradient hooks
//   per_transfer_ms     host work per pipeline transfer that the link cost does not see (headers,
//                       copies, posting the receive)
//   per_step_ms         fixed cost per step (optimizer launch, Python, barriers)
struct Calibration {
  double compute_scale = 1.0;
  double per_action_ms = 0.0;
  double per_transfer_ms = 0.0;
  double per_step_ms = 0.0;
};

// Bytes of optimizer state per parameter byte: SGD 0 (1 with momentum), Adam/AdamW 2.
struct TrainingSetup {
  int64_t batch = 64;                 // global samples per step
  double optimizer_state_factor = 1;  // SGD with momentum
  double optimizer_ms_per_byte = 0;   // the optimizer step's time per parameter byte (measured)
};

enum class Strategy { DataParallel, Pipeline, ParameterServer };

struct Configuration {
  Strategy strategy = Strategy::DataParallel;
  int world = 1;
  // DataParallel: bucket caps (bytes), DDP's defaults.
  int64_t first_bucket_bytes = 1 << 20;
  int64_t bucket_bytes = 25 << 20;
  // Pipeline: stages per replica = world / replicas, schedule and micro-batches per replica's batch.
  int replicas = 1;
  pipeline::ScheduleKind schedule = pipeline::ScheduleKind::OneFOneB;
  int microbatches = 1;
  int virtual_stages = 1;
  std::vector<int64_t> balance;  // layers per stage; empty: the balanced cut by time
  // ParameterServer: servers (the other world - servers ranks are workers), synchronous or not.
  int servers = 1;
  bool synchronous = true;
  std::string describe() const;  // "pipeline 1f1b, 2 stages x 2 replicas, 8 micro-batches"
};

struct Prediction {
  Configuration configuration;
  double step_ms = 0;
  double samples_per_second = 0;
  double compute_ms = 0;         // the busiest rank's compute per step
  double exposed_comm_ms = 0;    // step time not hidden behind compute
  double bubble_fraction = 0;    // pipeline: idle share of the ranks (0 otherwise)
  int64_t memory_per_rank = 0;   // the fullest rank's bytes: parameters, gradients, optimizer, activations
  int64_t bytes_per_step = 0;    // sent by one rank per step (the busiest)
  std::vector<int64_t> balance;  // pipeline: the cut used
};

// Each throws c10::Error naming what does not fit (batch not divisible, fewer layers than stages, ...).
Prediction predict_data_parallel(const ModelProfile& model, const NetworkProfile& network,
                                 const TrainingSetup& setup, const Configuration& configuration,
                                 const Calibration& calibration = {});
Prediction predict_pipeline(const ModelProfile& model, const NetworkProfile& network, const TrainingSetup& setup,
                            const Configuration& configuration, const Calibration& calibration = {});
Prediction predict_parameter_server(const ModelProfile& model, const NetworkProfile& network,
                                    const TrainingSetup& setup, const Configuration& configuration,
                                    const Calibration& calibration = {});
Prediction predict(const ModelProfile& model, const NetworkProfile& network, const TrainingSetup& setup,
                   const Configuration& configuration, const Calibration& calibration = {});

// The calibration under which the predictions of `configurations` come closest to `measured_ms`
// (least mean relative error; coordinate descent from no calibration over compute_scale in [0.5, 4],
// per_action_ms and per_transfer_ms in [0, 2], per_step_ms in [0, 5]).
Calibration fit_calibration(const ModelProfile& model, const NetworkProfile& network, const TrainingSetup& setup,
                            const std::vector<Configuration>& configurations, const std::vector<double>& measured_ms);

// Gradient buckets of DDP (or pushes of RemoteParameters) overlapping backward: bucket k becomes ready
// at `ready_ms[k]` (backward time when its last gradient is final) and takes `cost_ms[k]`; buckets go
// out one at a time in order. Returns when the last one finishes.
double overlapped_finish_ms(const std::vector<double>& ready_ms, const std::vector<double>& cost_ms);

} // namespace torchpar::plan
