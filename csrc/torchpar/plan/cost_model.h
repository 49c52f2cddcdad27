// The planner's cost model: from a model's per-layer profile and the measured cost of the process
// group's operations, the predicted step time and memory per rank of each strategy. Pure functions (no
// process group, no tensors), tested against hand-computed cases.
//
// Times are in milliseconds; a layer's times are measured at the profile's batch and at a smaller one,
// and scale linearly with the samples a rank computes per pass above a fixed overhead per pass.
#pragma once
#include <torchpar/pipeline/schedules.h>
#include <torchpar/plan/memory_model.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace torchpar::plan {

struct LayerProfile {
  std::string name;
  double forward_ms = 0;          // at ModelProfile::batch samples
  double backward_input_ms = 0;   // the input gradient's part of backward
  double backward_weight_ms = 0;  // the weight gradients' part
  int64_t parameter_bytes = 0;
  // What the layer's forward leaves alive until backward, at ModelProfile::batch samples: its output and what it
  // saves, less its input where it lets that go (measured on the layers chained as the model runs them, where CPU
  // allocations are counted: a layer that saves its input and one that saves its output keep one tensor between
  // them, not two; else its output). A stage also holds its input (input_bytes of its first layer).
  int64_t activation_bytes = 0;
  int64_t output_bytes = 0;  // what a stage boundary after this layer sends, at ModelProfile::batch
  int64_t input_bytes = 0;   // what reaches the layer, at ModelProfile::batch
  // The part of each time that does not shrink with fewer samples (kernel launches, Python,
  // allocation): a pass over n samples takes overhead + (time - overhead) * n / batch.
  double forward_overhead_ms = 0;
  double backward_input_overhead_ms = 0;
  double backward_weight_overhead_ms = 0;
  // An embedding table in the layer (part of parameter_bytes) that a parameter server can hold as
  // sparse rows, each worker pulling and pushing only the rows its samples touch.
  int64_t sparse_parameter_bytes = 0;
  int64_t sparse_bytes_per_sample = 0;  // rows one sample touches x a row's bytes
  // A Linear layer (with elementwise activations after it) whose weight a tensor group can split:
  // its features, 0 for any other layer.
  int64_t in_features = 0;
  int64_t out_features = 0;
  // Acts on each element alone (an activation between two Linear layers): tensor parallelism runs it on the split.
  bool elementwise = false;
  // Adds its weight gradient into the accumulated one itself (pipeline::Layer::accumulates_weight_gradient): a
  // pipeline stage's later micro-batches make no weight-sized gradient apart for it.
  bool accumulates_weight_gradient = false;
  // What its backward allocates at its peak beyond the gradients it leaves (at ModelProfile::batch samples;
  // measured where the CPU allocations are counted, else 0).
  int64_t backward_temporary_bytes = 0;
};

struct ModelProfile {
  int64_t batch = 1;  // the samples the layers were profiled with
  std::vector<LayerProfile> layers;
  // A rank's compute with every rank of the world computing at once over alone (measure_model_pass):
  // above 1 when ranks share cores or memory bandwidth. A configuration with fewer ranks busy at a
  // time (a pipeline's bubble, a parameter server's idle servers) slows in proportion.
  double contention = 1.0;
  // What glibc kept resident beyond the tensors' peak while one process trained the whole model at `batch`
  // samples (freed blocks re-made each step, under the project's allocator setting; measured, else 0): a
  // rank re-making a share of the model's gradients keeps that share of it, and at least those gradients.
  int64_t heap_retention_bytes = 0;
  int64_t parameter_bytes() const;
  double compute_ms() const;  // every layer's forward and backward at `batch` samples
  // The same profile with every time scaled so that compute_ms() is `pass_ms`: layers timed one at a
  // time give the shape (which layer, which part, what overhead), a longer run of whole passes the
  // level, which is steadier on a shared machine.
  ModelProfile scaled_to(double pass_ms) const;
};

// A collective's or transfer's cost, α + β · bytes, fitted from measurements (see network_profile).
struct LinkCost {
  double alpha_ms = 0;
  double ms_per_byte = 0;
  double milliseconds(double bytes) const { return bytes > 0 ? alpha_ms + ms_per_byte * bytes : 0; }
};

// The process group's operations, measured over all of its ranks (send_recv: between two of them;
// all_gather and reduce_scatter: by the bytes of the whole tensor), and one rank's memory copy while
// every rank copies (gradients into buckets, payloads into messages).
struct NetworkProfile {
  LinkCost all_reduce;
  LinkCost send_recv;
  LinkCost copy;
  LinkCost all_gather;
  LinkCost reduce_scatter;
  // A pipeline's transfer between neighbouring stage ranks, where it does not go through the group: on
  // one host through the pipeline's shared-memory rings (pipeline/same_host_rings.h). Unset: send_recv.
  std::optional<LinkCost> stage_transfer;
  const LinkCost& stage_link() const { return stage_transfer ? *stage_transfer : send_recv; }
  // DDP's bucket all-reduce, where it does not go through the group: beside a Gloo group of one host, through
  // an shm group over the same ranks (ddp.md). Unset: all_reduce.
  std::optional<LinkCost> ddp_all_reduce;
  const LinkCost& ddp_link() const { return ddp_all_reduce ? *ddp_all_reduce : all_reduce; }
  // DDP averages the gradients where they lie (its buckets go through an shm group: ddp.md), without
  // copying them into the buckets and back.
  bool ddp_in_place = false;
  // The sharded engine's reduce-scatters go through Gloo itself (no shm group beside it): torch's Gloo clones the
  // input and all-reduces the clone, which the op holds until it is waited for.
  bool reduce_scatter_clones_input = false;
  // Every rank on one host: the parameter server's payloads up to this many bytes go through its
  // shared-memory rings (ps/payload_ring.h: a Gloo frame, a copy in and a copy out); 0: through Gloo.
  int64_t ps_ring_bytes = 0;
  // What the host adds to a rank's resident set beyond its tensors (memory_model.h).
  HostMemory host_memory;
};

// What the model learns from measured runs (plan --verify), applied to every prediction:
//   compute_scale       compute in a strategy's step / the profile's (with its contention): what
//                       the step adds around the layers (Python hooks, the schedule's own work)
//   communication_scale the process group's operations while every rank computes / idle (ranks sharing
//                       cores wait for the scheduler between the hops of a collective); a pipeline's,
//                       in proportion to the ranks its bubble leaves computing
//   overlap             the share of gradient communication (DDP's all-reduces, a worker's pushes and
//                       pulls) that hides behind backward: 1 when every rank has a spare core for its
//                       communication thread, 0 when that thread takes the core backward runs on
//   per_action_ms       host work per pipeline compute action (F, B, I, W) that the layers' own
//                       times do not hold: the schedule's bookkeeping, the loss call, gradient hooks
//   per_transfer_ms     host work per pipeline transfer that the link cost does not see (headers,
//                       copies, posting the receive)
//   per_step_ms         fixed cost per step (optimizer launch, Python, barriers)
//   ps_ms_per_byte      a parameter server's host work per byte of a bucket's round trip beyond the
//                       measured copies and optimizer (encoding, request checks, the table's update)
//   ps_per_step_ms      a parameter server's fixed cost per step (its requests' dispatch, BSP's wait for
//                       the slowest worker)
//   ps_rows_ms          its fixed cost per step for sparse rows: the rows' pull before forward and push
//                       after backward, each a round trip of its own (the requests' dispatch and the
//                       wake-ups of ranks sharing cores, which the link's α, measured idle, does not see)
struct Calibration {
  double compute_scale = 1.0;
  double communication_scale = 1.0;
  double overlap = 1.0;
  double per_action_ms = 0.0;
  double per_transfer_ms = 0.0;
  double per_step_ms = 0.0;
  double ps_ms_per_byte = 0.0;
  double ps_per_step_ms = 0.0;
  double ps_rows_ms = 0.0;
};

// Bytes of optimizer state per parameter byte: SGD 0 (1 with momentum), Adam/AdamW 2.
struct TrainingSetup {
  int64_t batch = 64;                 // global samples per step
  double optimizer_state_factor = 1;  // SGD with momentum
  double optimizer_ms_per_byte = 0;   // the optimizer step's time per parameter byte (measured)
};

enum class Strategy { DataParallel, Pipeline, ParameterServer, TensorParallel, Sharded };

// How tensor parallelism splits each layer, Megatron-style: two splittable layers in a row become a
// column-parallel one (output features split, kept split) and a row-parallel one (input features
// split, outputs summed over the group), with the elementwise layers between them run on the split
// (Elementwise); one alone becomes column-parallel with its output gathered; any other layer runs whole
// on every rank of the group.
enum class TensorRole { Whole, Column, ColumnGathered, Row, Elementwise };

struct Configuration {
  Strategy strategy = Strategy::DataParallel;
  int world = 1;
  // DataParallel: bucket caps (bytes), DDP's defaults.
  int64_t first_bucket_bytes = 1 << 20;
  int64_t bucket_bytes = 25 << 20;
  // Pipeline: stages per replica = world / (replicas x tensor), schedule and micro-batches per replica's
  // batch; with tensor > 1 each stage's layers are split over a tensor group of that many ranks (3-D:
  // data x pipeline x tensor).
  int replicas = 1;
  int tensor = 1;
  pipeline::ScheduleKind schedule = pipeline::ScheduleKind::OneFOneB;
  int microbatches = 1;
  int virtual_stages = 1;
  std::vector<int64_t> balance;  // layers per stage; empty: the balanced cut by time
  // TensorParallel: tensor groups of world / replicas ranks, `replicas` data-parallel copies of them.
  // ParameterServer: servers (the other world - servers ranks are workers), synchronous or not.
  int servers = 1;
  bool synchronous = true;
  // Sharded: ZeRO's stage (1 optimizer state, 2 and gradients, 3 and parameters; each layer a unit at 3).
  int zero_stage = 2;
  std::string describe() const;  // "pipeline 1f1b, 2 stages x 2 replicas, 8 micro-batches"
};

struct Prediction {
  Configuration configuration;
  double step_ms = 0;
  double samples_per_second = 0;
  double compute_ms = 0;         // the busiest rank's compute per step
  double exposed_comm_ms = 0;    // step time not hidden behind compute
  double bubble_fraction = 0;    // pipeline: idle share of the ranks (0 otherwise)
  int64_t memory_per_rank = 0;   // the fullest rank's resident set: memory.total()
  int64_t tensor_memory_per_rank = 0;  // its tensors' peak (the allocator's view): memory.tensor_bytes()
  MemoryBreakdown memory;        // the fullest rank's, line by line
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
Prediction predict_tensor_parallel(const ModelProfile& model, const NetworkProfile& network,
                                   const TrainingSetup& setup, const Configuration& configuration,
                                   const Calibration& calibration = {});
// Sharded data parallelism (sharded/sharded_coordinator.h): DDP's compute, the gradient buckets reduce-scattered
// as backward produces them, the optimizer over 1/N of the parameters, then (stages 1-2) the updated shards
// all-gathered; at stage 3 each layer is a unit, all-gathered before its forward and again before its backward
// (no prefetch: the gathers are exposed). Memory by ZeRO's count plus the engine's flat shard copy.
Prediction predict_sharded(const ModelProfile& model, const NetworkProfile& network, const TrainingSetup& setup,
                           const Configuration& configuration, const Calibration& calibration = {});
Prediction predict(const ModelProfile& model, const NetworkProfile& network, const TrainingSetup& setup,
                   const Configuration& configuration, const Calibration& calibration = {});

std::vector<TensorRole> tensor_parallel_roles(const ModelProfile& model);
// The same within each pipeline stage of the cut `balance` (layers per stage): a pair never spans a cut.
std::vector<TensorRole> tensor_parallel_roles(const ModelProfile& model, const std::vector<int64_t>& balance);

// One verified configuration: what its prediction was made from, and its measured step time.
struct CalibrationSample {
  ModelProfile model;
  NetworkProfile network;
  TrainingSetup setup;
  Configuration configuration;
  double measured_ms = 0;
};

// A calibration's knob and the range fit_calibration searches it in (the planner's probes solve for a
// knob within the same range).
struct CalibrationKnob {
  const char* name;
  double Calibration::*field;
  double low, high, resolution;
  double unit;  // a departure from the start of one unit costs as much as a 10% error on every sample
};
// Every knob of Calibration, in its declaration order: compute_scale and communication_scale in [0.5, 4],
// overlap in [0, 1], per_action_ms and per_transfer_ms in [0, 2] ms, per_step_ms in [0, 5] ms,
// ps_ms_per_byte in [0, 2] ms/MiB, ps_per_step_ms and ps_rows_ms in [0, 20] ms.
const std::vector<CalibrationKnob>& calibration_knobs();

// The calibration under which the predictions of `samples` (from any models and runs on one machine)
// come closest to what was measured (least mean relative error; coordinate descent from `start` over
// calibration_knobs()).
Calibration fit_calibration(const std::vector<CalibrationSample>& samples, const Calibration& start = {});

// Gradient buckets of DDP (or pushes of RemoteParameters) overlapping backward: bucket k becomes ready
// at `ready_ms[k]` (backward time when its last gradient is final) and takes `cost_ms[k]`; buckets go
// out one at a time in order. Returns when the last one finishes, with `overlap` (Calibration::overlap)
// of the hiding behind backward that free overlap would give: at 0, backward then every bucket in turn.
double overlapped_finish_ms(const std::vector<double>& ready_ms, const std::vector<double>& cost_ms,
                            double backward_ms, double overlap = 1.0);

} // namespace torchpar::plan
