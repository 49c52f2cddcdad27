#include <torchpar/plan/planner.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
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

} // namespace

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
      auto prediction = predict(model_, network_, setup_, configuration, calibration_);
      if (options.memory_per_rank() > 0 && prediction.memory_per_rank > options.memory_per_rank()) {
        plan.excluded.push_back({configuration, "needs " + format_bytes(prediction.memory_per_rank) +
                                                    " per rank, over the " +
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

// The planner measures with freed memory kept (python/torchpar/allocator.py); so should the training it predicts.
constexpr const char* kKeepFreedMemoryCpp =
    "// launched with MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=268435456, as the planner measured\n";
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
