#include <torchpar/plan/planner.h>

#include <torchpar/pipeline/simulator.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <iomanip>
#include <sstream>

namespace torchpar::plan {
namespace {

std::string first_line(const c10::Error& error) {
  std::string message = error.what_without_backtrace();
  return message.substr(0, message.find('\n'));
}

// How a tensor group splits Linear layers, as code.
constexpr const char* tensor_layers_cpp =
    "// Linear layers in pairs: the first split by output features, the second by input features\n"
    "torchpar::tensor_parallel::ColumnParallelLinear up(\n"
    "    grid.tensor_group(), torchpar::tensor_parallel::ColumnParallelLinearOptions(width, hidden));\n"
    "torchpar::tensor_parallel::RowParallelLinear down(\n"
    "    grid.tensor_group(), torchpar::tensor_parallel::RowParallelLinearOptions(hidden, width));\n";
constexpr const char* tensor_layers_python =
    "# Linear layers in pairs: the first split by output features, the second by input features\n"
    "up = torchpar.tensor_parallel.ColumnParallelLinear(width, hidden, group=grid.tensor_group)\n"
    "down = torchpar.tensor_parallel.RowParallelLinear(hidden, width, group=grid.tensor_group)\n";

// Every cut of `layers` layers into `stages` non-empty stages, or none when there are more than `most` of them.
std::vector<std::vector<int64_t>> every_cut(int64_t layers, int64_t stages, double most) {
  double count = 1;  // C(layers - 1, stages - 1)
  for (int64_t k = 1; k < stages; ++k) count = count * static_cast<double>(layers - k) / static_cast<double>(k);
  if (stages < 1 || layers < stages || count > most) return {};
  std::vector<std::vector<int64_t>> cuts;
  std::vector<int64_t> cut;
  std::function<void(int64_t)> extend = [&](int64_t left) {
    const auto remaining_stages = stages - static_cast<int64_t>(cut.size());
    if (remaining_stages == 1) {
      cut.push_back(left);
      cuts.push_back(cut);
      cut.pop_back();
      return;
    }
    for (int64_t here = 1; here <= left - (remaining_stages - 1); ++here) {
      cut.push_back(here);
      extend(left - here);
      cut.pop_back();
    }
  };
  extend(layers);
  return cuts;
}

// Exhaustive up to this many cuts (a deep model's 8 layers into 4 stages: 35); beyond, a local search.
constexpr double kMostCutsTried = 512;

// Whether `a` is the better pipeline prediction under `cap` (0: none): fitting first, then the leaner of two
// that do not fit, then the faster.
bool better_under_cap(const Prediction& a, const Prediction& b, int64_t cap) {
  const int64_t over_a = cap > 0 ? std::max<int64_t>(0, a.memory_per_rank - cap) : 0;
  const int64_t over_b = cap > 0 ? std::max<int64_t>(0, b.memory_per_rank - cap) : 0;
  if (over_a != over_b) return over_a < over_b;
  return a.step_ms < b.step_ms;
}

// Where every cut is too many to try, for a pipeline of one stage per rank without tensor groups: the cut that
// minimises the slowest stage's time (the layers' profiled times) among those whose every stage's tensors
// (parameters, gradients, replicas' buckets, optimizer state, a layer's gradients before they are accumulated where
// it does not add them in itself, and the activations each rank holds in the schedule, simulated at equal costs)
// fit `cap` (0: none); where none fits, the one least over it. By dynamic programming over (stage, layers so far).
std::vector<int64_t> fastest_fitting_cut(const ModelProfile& model, const TrainingSetup& setup,
                                         const Configuration& configuration, int64_t cap) {
  pipeline::ScheduleSpec spec;
  spec.kind = configuration.schedule;
  spec.ranks = configuration.world / configuration.replicas;
  spec.microbatches = configuration.microbatches;
  const auto held = pipeline::simulate(spec, std::vector<pipeline::ActionCosts>(static_cast<size_t>(spec.ranks)))
                        .peak_activations;
  const int64_t micro = setup.batch / configuration.replicas / configuration.microbatches;
  const auto layers = static_cast<int64_t>(model.layers.size());
  const auto stages = static_cast<int64_t>(spec.ranks);
  // (bytes over the cap, slowest stage's ms) of the best cut of the first i layers into s stages.
  using Cost = std::pair<int64_t, double>;
  const Cost unreachable{std::numeric_limits<int64_t>::max(), 0};
  std::vector<std::vector<Cost>> best(static_cast<size_t>(stages + 1),
                                      std::vector<Cost>(static_cast<size_t>(layers + 1), unreachable));
  std::vector<std::vector<int64_t>> from(best.size(), std::vector<int64_t>(static_cast<size_t>(layers + 1), -1));
  best[0][0] = {0, 0.0};
  for (int64_t stage = 1; stage <= stages; ++stage) {
    for (int64_t end = stage; end <= layers - (stages - stage); ++end) {
      double parameters = 0, milliseconds = 0, largest = 0;
      int64_t activations = 0;
      for (int64_t begin = end - 1; begin >= stage - 1; --begin) {  // the stage is layers [begin, end)
        const auto& layer = model.layers[static_cast<size_t>(begin)];
        parameters += static_cast<double>(layer.parameter_bytes);
        if (!layer.accumulates_weight_gradient) largest = std::max(largest, static_cast<double>(layer.parameter_bytes));
        milliseconds += layer.forward_ms + layer.backward_input_ms + layer.backward_weight_ms;
        activations += layer.activation_bytes * micro / model.batch;
        const auto& before = best[static_cast<size_t>(stage - 1)][static_cast<size_t>(begin)];
        if (before == unreachable) continue;
        const int64_t memory =
            static_cast<int64_t>(parameters * (2 + (configuration.replicas > 1) + setup.optimizer_state_factor) +
                                 (configuration.microbatches > 1 ? largest : 0.0)) +
            held[static_cast<size_t>(stage - 1)] * (activations + layer.input_bytes * micro / model.batch);
        const Cost cost{std::max(before.first, cap > 0 ? std::max<int64_t>(0, memory - cap) : 0),
                        std::max(before.second, milliseconds)};
        auto& here = best[static_cast<size_t>(stage)][static_cast<size_t>(end)];
        if (cost < here) {
          here = cost;
          from[static_cast<size_t>(stage)][static_cast<size_t>(end)] = begin;
        }
      }
    }
  }
  std::vector<int64_t> cut(static_cast<size_t>(stages));
  for (int64_t stage = stages, end = layers; stage > 0; --stage) {
    const int64_t begin = from[static_cast<size_t>(stage)][static_cast<size_t>(end)];
    cut[static_cast<size_t>(stage - 1)] = end - begin;
    end = begin;
  }
  return cut;
}

} // namespace

Prediction predict_fastest_cut(const ModelProfile& model, const NetworkProfile& network, const TrainingSetup& setup,
                               const Configuration& configuration, const Calibration& calibration,
                               int64_t memory_per_rank) {
  TORCH_CHECK(configuration.strategy == Strategy::Pipeline, "predict_fastest_cut: a pipeline configuration");
  if (!configuration.balance.empty()) return predict(model, network, setup, configuration, calibration);
  Prediction best = predict(model, network, setup, configuration, calibration);  // the cut balanced by time
  const auto try_cut = [&](const std::vector<int64_t>& cut) {
    Configuration candidate = configuration;
    candidate.balance = cut;
    try {
      auto prediction = predict(model, network, setup, candidate, calibration);
      if (better_under_cap(prediction, best, memory_per_rank)) {
        best = std::move(prediction);
        return true;
      }
    } catch (const c10::Error&) {
      // a cut this configuration cannot take (a tensor pair split by it): the others may
    }
    return false;
  };
  const auto layers = static_cast<int64_t>(model.layers.size());
  const auto stages = static_cast<int64_t>(best.balance.size());
  const auto cuts = every_cut(layers, stages, kMostCutsTried);
  for (const auto& cut : cuts) try_cut(cut);
  if (!cuts.empty() || stages < 2) return best;
  // Too many cuts to try each: the dynamic programme's (one stage per rank, whole layers), then one layer moved
  // across one boundary at a time while that helps.
  if (configuration.virtual_stages == 1 && configuration.tensor == 1) {
    // The tensors' share of the cap: what the fullest rank of the cut by time holds beyond its tensors (rings,
    // glibc's retention, the process) is about what any cut's holds.
    const int64_t resident_only = best.memory_per_rank - best.tensor_memory_per_rank;
    try_cut(fastest_fitting_cut(model, setup, configuration,
                                memory_per_rank > 0 ? std::max<int64_t>(1, memory_per_rank - resident_only) : 0));
  }
  for (bool improved = true; improved;) {
    improved = false;
    const auto from = best.balance;
    for (size_t boundary = 0; boundary + 1 < from.size() && !improved; ++boundary) {
      for (const int64_t shift : {1, -1}) {
        auto cut = from;
        cut[boundary] += shift;
        cut[boundary + 1] -= shift;
        if (cut[boundary] < 1 || cut[boundary + 1] < 1) continue;
        if (try_cut(cut)) {
          improved = true;
          break;
        }
      }
    }
  }
  return best;
}

Planner::Planner(ModelProfile model, NetworkProfile network, TrainingSetup setup, Calibration calibration)
    : model_(std::move(model)), network_(network), setup_(setup), calibration_(calibration) {}

std::vector<Configuration> Planner::candidates(const PlanOptions& options) const {
  const int world = options.world();
  TORCH_CHECK(world >= 1, "plan: world must be at least 1, got ", world);
  std::vector<Configuration> configurations;
  if (options.data_parallel()) {
    Configuration ddp;
    ddp.strategy = Strategy::DataParallel;
    ddp.world = world;
    configurations.push_back(ddp);
  }
  if (options.sharded() && world > 1) {
    for (int stage : {1, 2, 3}) {
      Configuration sharded;
      sharded.strategy = Strategy::Sharded;
      sharded.world = world;
      sharded.zero_stage = stage;
      configurations.push_back(sharded);
    }
  }
  // Pipelines of tensor groups (3-D with replicas) where a layer splits and each replica has 2 stages or more.
  const bool splits = std::any_of(model_.layers.begin(), model_.layers.end(),
                                  [](const LayerProfile& layer) { return layer.out_features > 0; });
  std::vector<std::pair<int, int>> pipeline_shapes;  // (replicas, tensor)
  for (int replicas = 1; replicas <= world / 2; ++replicas) {
    for (int tensor = 1; replicas * tensor * 2 <= world; ++tensor) {
      if (world % (replicas * tensor) || (tensor > 1 && !(splits && options.tensor_parallel()))) continue;
      pipeline_shapes.emplace_back(replicas, tensor);
    }
  }
  if (options.pipeline()) {
    for (const auto& [replicas, tensor] : pipeline_shapes) {
      for (auto kind : {pipeline::ScheduleKind::GPipe, pipeline::ScheduleKind::OneFOneB,
                        pipeline::ScheduleKind::Interleaved1F1B, pipeline::ScheduleKind::ZeroBubbleH1}) {
        for (int microbatches : options.microbatches()) {
          Configuration pipe;
          pipe.strategy = Strategy::Pipeline;
          pipe.world = world;
          pipe.replicas = replicas;
          pipe.tensor = tensor;
          pipe.schedule = kind;
          pipe.virtual_stages = kind == pipeline::ScheduleKind::Interleaved1F1B ? 2 : 1;
          pipe.microbatches = microbatches;
          configurations.push_back(pipe);
        }
      }
    }
  }
  if (options.parameter_server()) {
    for (int servers = 1; servers <= world / 2; ++servers) {
      for (bool synchronous : {true, false}) {
        Configuration ps;
        ps.strategy = Strategy::ParameterServer;
        ps.world = world;
        ps.servers = servers;
        ps.synchronous = synchronous;
        configurations.push_back(ps);
      }
    }
  }
  if (options.tensor_parallel()) {
    for (int replicas = 1; replicas <= world / 2; ++replicas) {
      if (world % replicas) continue;
      Configuration tensor;
      tensor.strategy = Strategy::TensorParallel;
      tensor.world = world;
      tensor.replicas = replicas;
      configurations.push_back(tensor);
    }
  }
  return configurations;
}

Plan Planner::plan(const PlanOptions& options) const {
  Plan plan;
  for (const auto& configuration : candidates(options)) {
    try {
      const bool cut_to_choose = configuration.strategy == Strategy::Pipeline && configuration.balance.empty();
      auto prediction = cut_to_choose ? predict_fastest_cut(model_, network_, setup_, configuration, calibration_,
                                                            options.memory_per_rank())
                                      : predict(model_, network_, setup_, configuration, calibration_);
      if (options.memory_per_rank() > 0 && prediction.memory_per_rank > options.memory_per_rank()) {
        plan.excluded.push_back({configuration, (cut_to_choose ? "needs, cut the leanest way, " : "needs ") +
                                                    format_bytes(prediction.memory_per_rank) + " per rank, over the " +
                                                    format_bytes(options.memory_per_rank()) + " cap"});
        continue;
      }
      plan.ranked.push_back(std::move(prediction));
    } catch (const c10::Error& error) {
      plan.excluded.push_back({configuration, first_line(error)});
    }
  }
  std::stable_sort(plan.ranked.begin(), plan.ranked.end(),
                   [](const Prediction& a, const Prediction& b) { return a.step_ms < b.step_ms; });
  if (!plan.ranked.empty()) {
    auto best = plan.ranked.front().configuration;
    best.balance = plan.ranked.front().balance;
    const bool sparse_tables = std::any_of(model_.layers.begin(), model_.layers.end(),
                                           [](const LayerProfile& layer) { return layer.sparse_parameter_bytes > 0; });
    plan.recommended_cpp = cpp_code(best, sparse_tables);
    plan.recommended_python = python_code(best, sparse_tables);
  }
  return plan;
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.1f %s", value, units[unit]);
  return text;
}

std::string render_table(const Plan& plan) {
  std::ostringstream out;
  out << std::fixed;
  out << "  # | configuration                                        |  step ms | samples/s | memory/rank | bubble | "
         "sent/step\n";
  int position = 0;
  for (const auto& p : plan.ranked) {
    std::string name = p.configuration.describe();
    if (!p.balance.empty()) {
      name += ", cut";
      for (auto layers : p.balance) name.append(" ").append(std::to_string(layers));
    }
    out << std::setw(3) << ++position << " | " << std::left << std::setw(52) << name << std::right << " | "
        << std::setw(8) << std::setprecision(2) << p.step_ms << " | " << std::setw(9) << std::setprecision(1)
        << p.samples_per_second << " | " << std::setw(11) << format_bytes(p.memory_per_rank) << " | "
        << std::setw(5) << std::setprecision(0) << 100 * p.bubble_fraction << "% | "
        << format_bytes(p.bytes_per_step) << "\n";
  }
  if (!plan.excluded.empty()) {
    out << "excluded:\n";
    for (const auto& e : plan.excluded) out << "  " << e.configuration.describe() << ": " << e.reason << "\n";
  }
  return out.str();
}

// The planner measures with freed memory kept (common/cpu_allocations.h); so should the training it predicts.
constexpr const char* kKeepFreedMemoryCpp = "torchpar::keep_freed_memory();  // as the planner measured\n";
constexpr const char* kKeepFreedMemoryPython = "torchpar.keep_freed_memory()  # as the planner measured\n";

std::string cpp_code(const Configuration& c, bool sparse_tables) {
  std::ostringstream out;
  out << kKeepFreedMemoryCpp;
  switch (c.strategy) {
    case Strategy::DataParallel:
      out << "auto group = torchpar::init_process_group();\n"
             "torchpar::ddp::DistributedDataParallel model(module,\n"
             "    torchpar::ddp::DistributedDataParallelOptions().process_group(group));\n";
      break;
    case Strategy::Pipeline: {
      const bool grid = c.replicas > 1 || c.tensor > 1;
      out << "auto group = torchpar::init_process_group();\n";
      if (grid) {
        out << "torchpar::ParallelGrid grid(group, /*data=*/" << c.replicas << ", /*pipeline=*/"
            << c.world / (c.replicas * c.tensor) << ", /*tensor=*/" << c.tensor << ");\n";
      }
      if (c.tensor > 1) out << tensor_layers_cpp << "// (each a layer factory, the pairs within a stage)\n";
      out << "torchpar::pipeline::Pipeline pipe(layers, loss_fn, torchpar::pipeline::PipelineOptions()\n"
          << "    .process_group(" << (grid ? "grid.pipeline_group()" : "group") << ")"
          << (c.replicas > 1 ? ".data_parallel_group(grid.data_group())" : "") << "\n"
          << "    .schedule(\"" << pipeline::schedule_name(c.schedule) << "\").microbatches(" << c.microbatches << ")";
      if (c.virtual_stages > 1) out << ".virtual_stages(" << c.virtual_stages << ")";
      if (!c.balance.empty()) {
        out << ".balance({";
        for (size_t i = 0; i < c.balance.size(); ++i) out << (i ? ", " : "") << c.balance[i];
        out << "})";
      }
      out << ");\n";
      break;
    }
    case Strategy::ParameterServer:
      out << "auto group = torchpar::init_process_group();\n"
          << "torchpar::ps::ParameterService service(group, torchpar::ps::ServiceOptions()\n"
          << "    .num_servers(" << c.servers << ").consistency(torchpar::ps::Consistency::"
          << (c.synchronous ? "BSP" : "ASP") << "));\n"
          << "if (service.is_server()) { service.serve(); return 0; }\n"
          << "torchpar::ps::RemoteParameters parameters(service.client(), module->named_parameters(),\n"
          << "                                          torchpar::ps::OptimizerConfig::sgd(0.1));\n";
      if (sparse_tables) {
        out << "// the embedding as sparse rows on the servers (in the module, before RemoteParameters):\n"
            << "torchpar::ps::Embedding embedding(service.client(), \"embedding\", rows, dim,\n"
            << "                                  torchpar::ps::OptimizerConfig::adagrad(0.1));\n";
      }
      break;
    case Strategy::TensorParallel:
      out << "auto group = torchpar::init_process_group();\n"
          << "torchpar::ParallelGrid grid(group, /*data=*/" << c.replicas << ", /*pipeline=*/1, /*tensor=*/"
          << c.world / c.replicas << ");\n"
          << tensor_layers_cpp;
      if (c.replicas > 1) out << "// gradients averaged over grid.data_group() after backward\n";
      break;
    case Strategy::Sharded:
      out << "auto group = torchpar::init_process_group();\n"
          << "torchpar::sharded::ShardedDataParallel model(module, torchpar::sharded::ShardedOptions()\n"
          << "    .process_group(group).stage(" << c.zero_stage << ")"
          << (c.zero_stage == 3 ? ".units({/* each layer's name */})" : "") << ");\n"
          << "auto optimizer = model.optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3));\n";
      break;
  }
  return out.str();
}

std::string python_code(const Configuration& c, bool sparse_tables) {
  std::ostringstream out;
  out << kKeepFreedMemoryPython;
  switch (c.strategy) {
    case Strategy::DataParallel:
      out << "torchpar.init_process_group()\nmodel = torchpar.DistributedDataParallel(model)\n";
      break;
    case Strategy::Pipeline: {
      out << "torchpar.init_process_group()\n";
      if (c.replicas > 1 || c.tensor > 1) {
        out << "grid = torchpar.ParallelGrid(data=" << c.replicas << ", pipeline=" << c.world / (c.replicas * c.tensor)
            << ", tensor=" << c.tensor << ")\n";
      }
      if (c.tensor > 1) out << tensor_layers_python << "# (each built by a layer factory, the pairs within a stage)\n";
      out << "pipe = torchpar.pipeline.Pipeline(layers, loss_fn, schedule=\"" << pipeline::schedule_name(c.schedule)
          << "\", microbatches=" << c.microbatches;
      if (c.virtual_stages > 1) out << ", virtual_stages=" << c.virtual_stages;
      if (!c.balance.empty()) {
        out << ", balance=[";
        for (size_t i = 0; i < c.balance.size(); ++i) out << (i ? ", " : "") << c.balance[i];
        out << "]";
      }
      if (c.replicas > 1 || c.tensor > 1) out << ",\n    process_group=grid.pipeline_group";
      if (c.replicas > 1) out << ", data_parallel_group=grid.data_group";
      out << ")\n";
      break;
    }
    case Strategy::ParameterServer:
      out << "torchpar.init_process_group()\n"
          << "service = torchpar.ps.ParameterService(servers=" << c.servers << ", consistency=\""
          << (c.synchronous ? "bsp" : "asp") << "\")\n"
          << "if service.is_server:\n    service.serve()\nelse:\n"
          << (sparse_tables ? "    # the embedding as sparse rows on the servers (in the model, before "
                              "RemoteParameters):\n"
                              "    model.embedding = torchpar.ps.Embedding(service.client, \"embedding\", rows, dim)\n"
                            : "")
          << "    params = torchpar.ps.RemoteParameters(model, service.client, torchpar.ps.SGD(lr=0.1))\n";
      break;
    case Strategy::TensorParallel:
      out << "torchpar.init_process_group()\n"
          << "grid = torchpar.ParallelGrid(data=" << c.replicas << ", tensor=" << c.world / c.replicas << ")\n"
          << tensor_layers_python;
      if (c.replicas > 1) out << "# gradients averaged over grid.data_group after backward\n";
      break;
    case Strategy::Sharded:
      out << "torchpar.init_process_group()\n"
          << "model = torchpar.ShardedDataParallel(model, stage=" << c.zero_stage
          << (c.zero_stage == 3 ? ", units=[...]  # each layer" : "") << ")\n"
          << "optimizer = torchpar.ShardedOptimizer(model, torch.optim.Adam, lr=1e-3)\n";
      break;
  }
  return out.str();
}

} // namespace torchpar::plan
