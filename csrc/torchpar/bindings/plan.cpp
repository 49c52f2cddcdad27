// torchpar._C.plan: the planner's profile, cost model and search under python/torchpar/plan.
#include <torchpar/bindings/bindings.h>

#include <torchpar/comm/shm/layout.h>
#include <torchpar/plan/calibration_store.h>
#include <torchpar/plan/planner.h>
#include <torchpar/plan/profile.h>

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace torchpar::bindings {

namespace py = pybind11;
namespace plan = torchpar::plan;

void bind_plan(py::module_& module) {
  auto m = module.def_submodule("plan", "C++ planner: profile, cost model, search");
  using Release = py::call_guard<py::gil_scoped_release>;

  py::class_<plan::LayerProfile>(m, "LayerProfile")
      .def(py::init<>())
      .def_readwrite("name", &plan::LayerProfile::name)
      .def_readwrite("forward_ms", &plan::LayerProfile::forward_ms)
      .def_readwrite("backward_input_ms", &plan::LayerProfile::backward_input_ms)
      .def_readwrite("backward_weight_ms", &plan::LayerProfile::backward_weight_ms)
      .def_readwrite("forward_overhead_ms", &plan::LayerProfile::forward_overhead_ms)
      .def_readwrite("backward_input_overhead_ms", &plan::LayerProfile::backward_input_overhead_ms)
      .def_readwrite("backward_weight_overhead_ms", &plan::LayerProfile::backward_weight_overhead_ms)
      .def_readwrite("parameter_bytes", &plan::LayerProfile::parameter_bytes)
      .def_readwrite("activation_bytes", &plan::LayerProfile::activation_bytes)
      .def_readwrite("input_bytes", &plan::LayerProfile::input_bytes)
      .def_readwrite("output_bytes", &plan::LayerProfile::output_bytes)
      .def_readwrite("sparse_parameter_bytes", &plan::LayerProfile::sparse_parameter_bytes)
      .def_readwrite("sparse_bytes_per_sample", &plan::LayerProfile::sparse_bytes_per_sample)
      .def_readwrite("in_features", &plan::LayerProfile::in_features)
      .def_readwrite("out_features", &plan::LayerProfile::out_features)
      .def_readwrite("elementwise", &plan::LayerProfile::elementwise)
      .def_readwrite("accumulates_weight_gradient", &plan::LayerProfile::accumulates_weight_gradient)
      .def_readwrite("backward_temporary_bytes", &plan::LayerProfile::backward_temporary_bytes);
  py::class_<plan::ModelProfile>(m, "ModelProfile")
      .def(py::init<>())
      .def_readwrite("batch", &plan::ModelProfile::batch)
      .def_readwrite("layers", &plan::ModelProfile::layers)
      .def_readwrite("contention", &plan::ModelProfile::contention)
      .def_readwrite("heap_retention_bytes", &plan::ModelProfile::heap_retention_bytes)
      .def_property_readonly("parameter_bytes", &plan::ModelProfile::parameter_bytes)
      .def_property_readonly("compute_ms", &plan::ModelProfile::compute_ms)
      .def("scaled_to", &plan::ModelProfile::scaled_to, py::arg("pass_ms"));
  py::class_<plan::ModelPassTimes>(m, "ModelPassTimes")
      .def_readonly("alone_ms", &plan::ModelPassTimes::alone_ms)
      .def_readonly("together_ms", &plan::ModelPassTimes::together_ms);
  py::class_<plan::LinkCost>(m, "LinkCost")
      .def(py::init<>())
      .def_readwrite("alpha_ms", &plan::LinkCost::alpha_ms)
      .def_readwrite("ms_per_byte", &plan::LinkCost::ms_per_byte)
      .def("milliseconds", &plan::LinkCost::milliseconds, py::arg("bytes"));
  py::class_<plan::HostMemory>(m, "HostMemory")
      .def(py::init<>())
      .def_readwrite("process_overhead_bytes", &plan::HostMemory::process_overhead_bytes)
      .def_readwrite("stage_ring_bytes", &plan::HostMemory::stage_ring_bytes)
      .def_readwrite("shm_chunk_bytes", &plan::HostMemory::shm_chunk_bytes)
      .def_readwrite("keeps_freed_memory", &plan::HostMemory::keeps_freed_memory);
  py::class_<plan::MemoryLine>(m, "MemoryLine")
      .def_readonly("what", &plan::MemoryLine::what)
      .def_readonly("bytes", &plan::MemoryLine::bytes)
      .def_readonly("tensor", &plan::MemoryLine::tensor);
  py::class_<plan::MemoryBreakdown>(m, "MemoryBreakdown")
      .def_readonly("lines", &plan::MemoryBreakdown::lines)
      .def_property_readonly("tensor_bytes", &plan::MemoryBreakdown::tensor_bytes)
      .def_property_readonly("total", &plan::MemoryBreakdown::total)
      .def("render", &plan::MemoryBreakdown::render);
  py::class_<plan::NetworkProfile>(m, "NetworkProfile")
      .def(py::init<>())
      .def_readwrite("all_reduce", &plan::NetworkProfile::all_reduce)
      .def_readwrite("send_recv", &plan::NetworkProfile::send_recv)
      .def_readwrite("copy", &plan::NetworkProfile::copy)
      .def_readwrite("all_gather", &plan::NetworkProfile::all_gather)
      .def_readwrite("reduce_scatter", &plan::NetworkProfile::reduce_scatter)
      .def_readwrite("stage_transfer", &plan::NetworkProfile::stage_transfer)
      .def_readwrite("ddp_all_reduce", &plan::NetworkProfile::ddp_all_reduce)
      .def_readwrite("ddp_in_place", &plan::NetworkProfile::ddp_in_place)
      .def_readwrite("reduce_scatter_clones_input", &plan::NetworkProfile::reduce_scatter_clones_input)
      .def_readwrite("ps_ring_bytes", &plan::NetworkProfile::ps_ring_bytes)
      .def_readwrite("host_memory", &plan::NetworkProfile::host_memory);
  py::class_<plan::Calibration>(m, "Calibration")
      .def(py::init<>())
      .def_readwrite("compute_scale", &plan::Calibration::compute_scale)
      .def_readwrite("communication_scale", &plan::Calibration::communication_scale)
      .def_readwrite("overlap", &plan::Calibration::overlap)
      .def_readwrite("per_action_ms", &plan::Calibration::per_action_ms)
      .def_readwrite("per_transfer_ms", &plan::Calibration::per_transfer_ms)
      .def_readwrite("per_step_ms", &plan::Calibration::per_step_ms)
      .def_readwrite("ps_ms_per_byte", &plan::Calibration::ps_ms_per_byte)
      .def_readwrite("ps_per_step_ms", &plan::Calibration::ps_per_step_ms)
      .def_readwrite("ps_rows_ms", &plan::Calibration::ps_rows_ms);
  py::class_<plan::TrainingSetup>(m, "TrainingSetup")
      .def(py::init<>())
      .def_readwrite("batch", &plan::TrainingSetup::batch)
      .def_readwrite("optimizer_state_factor", &plan::TrainingSetup::optimizer_state_factor)
      .def_readwrite("optimizer_ms_per_byte", &plan::TrainingSetup::optimizer_ms_per_byte);
  py::enum_<plan::Strategy>(m, "Strategy")
      .value("ddp", plan::Strategy::DataParallel)
      .value("pipeline", plan::Strategy::Pipeline)
      .value("ps", plan::Strategy::ParameterServer)
      .value("tensor", plan::Strategy::TensorParallel)
      .value("sharded", plan::Strategy::Sharded);
  py::class_<plan::Configuration>(m, "Configuration")
      .def(py::init<>())
      .def_readwrite("strategy", &plan::Configuration::strategy)
      .def_readwrite("world", &plan::Configuration::world)
      .def_readwrite("first_bucket_bytes", &plan::Configuration::first_bucket_bytes)
      .def_readwrite("bucket_bytes", &plan::Configuration::bucket_bytes)
      .def_readwrite("replicas", &plan::Configuration::replicas)
      .def_readwrite("tensor", &plan::Configuration::tensor)
      .def_property(
          "schedule", [](const plan::Configuration& c) { return pipeline::schedule_name(c.schedule); },
          [](plan::Configuration& c, const std::string& name) { c.schedule = pipeline::parse_schedule(name); })
      .def_readwrite("microbatches", &plan::Configuration::microbatches)
      .def_readwrite("virtual_stages", &plan::Configuration::virtual_stages)
      .def_readwrite("balance", &plan::Configuration::balance)
      .def_readwrite("servers", &plan::Configuration::servers)
      .def_readwrite("synchronous", &plan::Configuration::synchronous)
      .def_readwrite("zero_stage", &plan::Configuration::zero_stage)
      .def("describe", &plan::Configuration::describe);
  py::class_<plan::Prediction>(m, "Prediction")
      .def_readonly("configuration", &plan::Prediction::configuration)
      .def_readonly("step_ms", &plan::Prediction::step_ms)
      .def_readonly("samples_per_second", &plan::Prediction::samples_per_second)
      .def_readonly("compute_ms", &plan::Prediction::compute_ms)
      .def_readonly("exposed_comm_ms", &plan::Prediction::exposed_comm_ms)
      .def_readonly("bubble_fraction", &plan::Prediction::bubble_fraction)
      .def_readonly("memory_per_rank", &plan::Prediction::memory_per_rank)
      .def_readonly("tensor_memory_per_rank", &plan::Prediction::tensor_memory_per_rank)
      .def_readonly("memory", &plan::Prediction::memory)
      .def_readonly("bytes_per_step", &plan::Prediction::bytes_per_step)
      .def_readonly("balance", &plan::Prediction::balance);
  py::class_<plan::Excluded>(m, "Excluded")
      .def_readonly("configuration", &plan::Excluded::configuration)
      .def_readonly("reason", &plan::Excluded::reason);
  py::class_<plan::Plan>(m, "Plan")
      .def_readonly("ranked", &plan::Plan::ranked)
      .def_readonly("excluded", &plan::Plan::excluded)
      .def_readonly("recommended_cpp", &plan::Plan::recommended_cpp)
      .def_readonly("recommended_python", &plan::Plan::recommended_python);

  m.attr("SHM_CHUNK_BYTES") = static_cast<int64_t>(comm::shm::kChunkBytes);
  m.def("predict", &plan::predict, py::arg("model"), py::arg("network"), py::arg("setup"), py::arg("configuration"),
        py::arg("calibration") = plan::Calibration());
  m.def(
      "plan",
      [](const plan::ModelProfile& model, const plan::NetworkProfile& network, const plan::TrainingSetup& setup,
         const plan::Calibration& calibration, int world, int64_t memory_per_rank, std::vector<int> microbatches) {
        return plan::Planner(model, network, setup, calibration)
            .plan(plan::PlanOptions().world(world).memory_per_rank(memory_per_rank).microbatches(microbatches));
      },
      py::arg("model"), py::arg("network"), py::arg("setup"), py::arg("calibration"), py::arg("world"),
      py::arg("memory_per_rank"), py::arg("microbatches"));
  py::class_<plan::CalibrationSample>(m, "CalibrationSample")
      .def(py::init<>())
      .def_readwrite("model", &plan::CalibrationSample::model)
      .def_readwrite("network", &plan::CalibrationSample::network)
      .def_readwrite("setup", &plan::CalibrationSample::setup)
      .def_readwrite("configuration", &plan::CalibrationSample::configuration)
      .def_readwrite("measured_ms", &plan::CalibrationSample::measured_ms);
  m.def("fit_calibration", &plan::fit_calibration, py::arg("samples"), py::arg("start") = plan::Calibration(),
        Release());
  m.def("calibration_bounds", [] {
    py::dict bounds;  // in the knobs' declaration order
    for (const auto& knob : plan::calibration_knobs()) bounds[knob.name] = py::make_tuple(knob.low, knob.high);
    return bounds;
  });
  m.def("calibration_file", &plan::calibration_file,
        "Where --verify keeps what it learned on this machine: $TORCHPAR_PLAN_CALIBRATION, else "
        "$XDG_CACHE_HOME/torchpar/plan_calibration.pt, else ~/.cache/torchpar/plan_calibration.pt.");
  m.def("default_calibration", &plan::default_calibration, py::arg("world"));
  m.def("describe_calibration", &plan::describe, py::arg("calibration"));
  m.def("calibration_key", &plan::calibration_key, py::arg("world"), py::arg("backend"));
  py::class_<plan::CalibrationStore>(m, "CalibrationStore")
      .def(py::init([](std::optional<std::string> path) {
             return path ? plan::CalibrationStore(*path) : plan::CalibrationStore();
           }),
           py::arg("path") = py::none())
      .def_property_readonly("path", &plan::CalibrationStore::path)
      .def("calibration", &plan::CalibrationStore::calibration, py::arg("world"), py::arg("backend"))
      .def("samples", &plan::CalibrationStore::samples, py::arg("world"), py::arg("backend"))
      .def(
          "learn",
          [](plan::CalibrationStore& store, const std::vector<plan::CalibrationSample>& samples, int world,
             const std::string& backend, const plan::Calibration& start) {
            plan::LearnedCalibration learned;
            {
              py::gil_scoped_release release;  // the fit predicts every sample many times over
              learned = store.learn(samples, world, backend, start);
            }
            return py::make_tuple(learned.calibration, learned.samples);
          },
          py::arg("samples"), py::arg("world"), py::arg("backend"), py::arg("start"),
          "Adds `samples` to those kept for this world and backend, fits the calibration to all of them from "
          "`start`, keeps both; returns (calibration, how many samples it rests on).");
  m.def("render_table", &plan::render_table, py::arg("plan"));
  m.def(
      "tensor_parallel_roles",
      [](const plan::ModelProfile& model, const std::vector<int64_t>& balance) {
        std::vector<std::string> names;
        for (const auto role : balance.empty() ? plan::tensor_parallel_roles(model)
                                               : plan::tensor_parallel_roles(model, balance)) {
          switch (role) {
            case plan::TensorRole::Whole: names.emplace_back("whole"); break;
            case plan::TensorRole::Column: names.emplace_back("column"); break;
            case plan::TensorRole::ColumnGathered: names.emplace_back("column_gathered"); break;
            case plan::TensorRole::Row: names.emplace_back("row"); break;
            case plan::TensorRole::Elementwise: names.emplace_back("elementwise"); break;
          }
        }
        return names;
      },
      py::arg("model"), py::arg("balance") = std::vector<int64_t>(),
      "Each layer's part under tensor parallelism (within each stage of the pipeline cut `balance`, layers per "
      "stage, if given): whole, column, column_gathered, row or elementwise (between a column and a row).");
  m.def(
      "profile_layers",
      [](const std::vector<pipeline::LayerFactory>& factories, const pipeline::Tensors& sample, int repeats,
         double optimizer_state_factor) {
        plan::TrainingSetup setup;
        setup.optimizer_state_factor = optimizer_state_factor;
        plan::ModelProfile model;
        {
          py::gil_scoped_release release;  // autograd runs without it; the Python layers take it back
          model = plan::profile_layers(factories, sample, repeats, &setup);
        }
        return py::make_tuple(model, setup.optimizer_ms_per_byte);
      },
      py::arg("factories"), py::arg("sample"), py::arg("repeats"), py::arg("optimizer_state_factor") = 1.0);
  m.def("measure_model_pass", &plan::measure_model_pass, py::arg("factories"), py::arg("sample"), py::arg("group"),
        Release());
  m.def("measure_network", &plan::measure_network, py::arg("group"), py::arg("sizes_bytes"), py::arg("repeats"),
        Release());
}

} // namespace torchpar::bindings
