// Which strategy, with which settings, for this model on these ranks: every configuration the world
// allows, predicted by the cost model (cost_model.h), ranked by predicted samples/s among those that fit
// the memory per rank (a pipeline at its fastest cut within it); the others listed with the reason they are out.
//
//   torchpar::plan::Planner planner(profile, network, setup);          // profile.h measures both
//   auto plan = planner.plan(PlanOptions().world(4).memory_per_rank(2LL << 30));
//   std::cout << render_table(plan) << plan.recommended_cpp;
#pragma once
#include <torchpar/plan/cost_model.h>

#include <torch/arg.h>

#include <optional>
#include <string>
#include <vector>

namespace torchpar::plan {

struct PlanOptions {
  TORCH_ARG(int, world) = 1;
  // Bytes a rank may use for parameters, gradients, optimizer state and activations; 0: no cap.
  TORCH_ARG(int64_t, memory_per_rank) = 0;
  // Micro-batch counts tried for the pipeline (those dividing a replica's batch).
  TORCH_ARG(std::vector<int>, microbatches) = std::vector<int>{1, 2, 4, 8, 16};
  TORCH_ARG(bool, data_parallel) = true;
  TORCH_ARG(bool, pipeline) = true;
  TORCH_ARG(bool, parameter_server) = true;
  TORCH_ARG(bool, tensor_parallel) = true;
  TORCH_ARG(bool, sharded) = true;  // ZeRO stages 1, 2 and 3
};

struct Excluded {
  Configuration configuration;
  std::string reason;  // "needs 3.1 GiB per rank, over the 2 GiB cap", "batch 64 does not divide into 3 ranks"
};

struct Plan {
  std::vector<Prediction> ranked;  // fastest first
  std::vector<Excluded> excluded;
  std::string recommended_cpp;     // the top configuration as code to paste
  std::string recommended_python;
};

// A pipeline configuration with no cut given, at the cut of its layers the cost model predicts fastest among those
// within `memory_per_rank` (0: no cap); where none fits, the leanest. Every cut is tried where there are at most
// 512 (8 layers into 4 stages: 35), else one layer moved across one boundary at a time from the cut balanced by
// time, while that helps. A configuration with a cut is predicted at it.
Prediction predict_fastest_cut(const ModelProfile& model, const NetworkProfile& network, const TrainingSetup& setup,
                               const Configuration& configuration, const Calibration& calibration = {},
                               int64_t memory_per_rank = 0);

class Planner {
 public:
  Planner(ModelProfile model, NetworkProfile network, TrainingSetup setup, Calibration calibration = {});
  // Every configuration of `options.world()` ranks the options allow.
  std::vector<Configuration> candidates(const PlanOptions& options) const;
  Plan plan(const PlanOptions& options) const;

 private:
  ModelProfile model_;
  NetworkProfile network_;
  TrainingSetup setup_;
  Calibration calibration_;
};

// "1.5 GiB", "12.0 MiB", "512 B"
std::string format_bytes(int64_t bytes);
// The ranked table (rank, configuration, step ms, samples/s, memory per rank, bubble, bytes per step),
// then the excluded configurations with their reasons.
std::string render_table(const Plan& plan);
// The configuration as C++ and as Python code constructing it.
// `sparse_tables`: the model has embedding tables a parameter server keeps as sparse rows.
std::string cpp_code(const Configuration& configuration, bool sparse_tables = false);
std::string python_code(const Configuration& configuration, bool sparse_tables = false);

} // namespace torchpar::plan
