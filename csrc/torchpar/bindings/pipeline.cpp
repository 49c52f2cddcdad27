// torchpar._C.pipeline: schedules, simulator, partitioner and the pipeline runtime under
// python/torchpar/pipeline.
#include <torchpar/bindings/bindings.h>

#include <torchpar/pipeline/linear_layer.h>
#include <torchpar/pipeline/partition.h>
#include <torchpar/pipeline/pipeline.h>
#include <torchpar/pipeline/simulator.h>

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <variant>

namespace torchpar::bindings {

namespace py = pybind11;
namespace pp = torchpar::pipeline;

namespace {

pp::ScheduleSpec make_spec(const std::string& schedule, int ranks, int microbatches, int virtual_stages) {
  pp::ScheduleSpec spec;
  spec.kind = pp::parse_schedule(schedule);
  spec.ranks = ranks;
  spec.microbatches = microbatches;
  spec.virtual_stages = virtual_stages;
  return spec;
}

// A tied parameter as Python spells it: (layer index, parameter name or position).
using PyParameterRef = std::tuple<int64_t, std::variant<int64_t, std::string>>;
using PySharedGroups = std::vector<std::vector<PyParameterRef>>;

std::vector<pp::SharedParameterGroup> from_python(const PySharedGroups& groups) {
  std::vector<pp::SharedParameterGroup> result;
  for (const auto& group : groups) {
    pp::SharedParameterGroup refs;
    for (const auto& [layer, parameter] : group) {
      if (const auto* index = std::get_if<int64_t>(&parameter)) {
        refs.emplace_back(layer, *index);
      } else {
        refs.emplace_back(layer, std::get<std::string>(parameter));
      }
    }
    result.push_back(std::move(refs));
  }
  return result;
}

PySharedGroups to_python(const std::vector<pp::SharedParameterGroup>& groups) {
  PySharedGroups result;
  for (const auto& group : groups) {
    std::vector<PyParameterRef> refs;
    for (const auto& ref : group) {
      refs.emplace_back(ref.layer, ref.by_name() ? std::variant<int64_t, std::string>(ref.name)
                                                 : std::variant<int64_t, std::string>(ref.index));
    }
    result.push_back(std::move(refs));
  }
  return result;
}

pp::ActionCosts make_costs(double forward, double backward, double backward_input, double backward_weight,
                           double transfer) {
  pp::ActionCosts costs;
  costs.transfer = transfer;
  costs.forward = forward;
  costs.backward = backward;
  costs.backward_input = backward_input;
  costs.backward_weight = backward_weight;
  return costs;
}

} // namespace

void bind_pipeline(py::module_& module) {
  auto pipeline = module.def_submodule("pipeline", "C++ pipeline-parallel engine");

  py::enum_<pp::ActionType>(pipeline, "ActionType")
      .value("F", pp::ActionType::Forward)
      .value("B", pp::ActionType::Backward)
      .value("I", pp::ActionType::BackwardInput)
      .value("W", pp::ActionType::BackwardWeight)
      .value("SEND_F", pp::ActionType::SendActivation)
      .value("RECV_F", pp::ActionType::RecvActivation)
      .value("SEND_B", pp::ActionType::SendGradient)
      .value("RECV_B", pp::ActionType::RecvGradient);

  py::class_<pp::Action>(pipeline, "Action")
      .def(py::init([](pp::ActionType type, int stage, int microbatch) { return pp::Action{type, stage, microbatch}; }),
           py::arg("type"), py::arg("stage"), py::arg("microbatch"))
      .def_readonly("type", &pp::Action::type)
      .def_readonly("stage", &pp::Action::stage)
      .def_readonly("microbatch", &pp::Action::microbatch)
      .def_property_readonly("is_compute", [](const pp::Action& action) { return pp::is_compute(action.type); })
      .def("__eq__",
           [](const pp::Action& self, const py::object& other) {
             return py::isinstance<pp::Action>(other) && self == other.cast<pp::Action>();
           })
      .def("__hash__", [](const pp::Action& action) {
        return py::hash(py::make_tuple(static_cast<int>(action.type), action.stage, action.microbatch));
      })
      .def("__repr__", [](const pp::Action& action) { return pp::to_string(action); });

  pipeline.def("schedule_names", &pp::schedule_names);
  pipeline.def(
      "compute_actions",
      [](const std::string& schedule, int ranks, int microbatches, int virtual_stages, int rank) {
        return pp::compute_actions(make_spec(schedule, ranks, microbatches, virtual_stages), rank);
      },
      py::arg("schedule"), py::arg("ranks"), py::arg("microbatches"), py::arg("virtual_stages"), py::arg("rank"));
  pipeline.def(
      "rank_actions",
      [](const std::string& schedule, int ranks, int microbatches, int virtual_stages, int rank) {
        return pp::rank_actions(make_spec(schedule, ranks, microbatches, virtual_stages), rank);
      },
      py::arg("schedule"), py::arg("ranks"), py::arg("microbatches"), py::arg("virtual_stages"), py::arg("rank"));

  py::class_<pp::TimedAction>(pipeline, "TimedAction")
      .def_readonly("action", &pp::TimedAction::action)
      .def_readonly("start", &pp::TimedAction::start)
      .def_readonly("end", &pp::TimedAction::end);
  py::class_<pp::Simulation>(pipeline, "Simulation")
      .def_readonly("ranks", &pp::Simulation::ranks)
      .def_readonly("stages", &pp::Simulation::stages)
      .def_readonly("microbatches", &pp::Simulation::microbatches)
      .def_readonly("timeline", &pp::Simulation::timeline)
      .def_readonly("makespan", &pp::Simulation::makespan)
      .def_readonly("bubble_fraction", &pp::Simulation::bubble_fraction)
      .def_readonly("peak_activations", &pp::Simulation::peak_activations)
      .def("grid", [](const pp::Simulation& simulation) { return pp::render_grid(simulation); });

  pipeline.def(
      "simulate",
      [](const std::string& schedule, int ranks, int microbatches, int virtual_stages, double forward, double backward,
         double backward_input, double backward_weight, double transfer) {
        return pp::simulate(make_spec(schedule, ranks, microbatches, virtual_stages),
                            make_costs(forward, backward, backward_input, backward_weight, transfer));
      },
      py::arg("schedule"), py::arg("ranks"), py::arg("microbatches"), py::arg("virtual_stages") = 1,
      py::arg("forward") = 1.0, py::arg("backward") = 2.0, py::arg("backward_input") = 1.0,
      py::arg("backward_weight") = 1.0, py::arg("transfer") = 0.0);
  pipeline.def(
      "simulate_stages",
      [](const std::string& schedule, int ranks, int microbatches, int virtual_stages,
         const std::vector<std::map<std::string, double>>& stage_costs) {
        return pp::simulate(make_spec(schedule, ranks, microbatches, virtual_stages),
                            pp::parse_stage_costs(stage_costs));
      },
      py::arg("schedule"), py::arg("ranks"), py::arg("microbatches"), py::arg("virtual_stages"),
      py::arg("stage_costs"));
  pipeline.def(
      "simulate_actions",
      [](const std::vector<std::vector<pp::Action>>& actions, int stages, int microbatches) {
        return pp::simulate(actions, stages, microbatches);
      },
      py::arg("actions"), py::arg("stages"), py::arg("microbatches"));

  pipeline.def("uniform_partition", &pp::uniform_partition, py::arg("layers"), py::arg("stages"));
  pipeline.def("balanced_partition", &pp::balanced_partition, py::arg("costs"), py::arg("stages"));
  pipeline.def("describe_partition", &pp::describe_partition, py::arg("balance"), py::arg("costs"), py::arg("unit"));

  py::class_<pp::LayerTraits>(pipeline, "LayerTraits")
      .def(py::init<>())
      .def_readwrite("split_in_features", &pp::LayerTraits::split_in_features)
      .def_readwrite("split_out_features", &pp::LayerTraits::split_out_features)
      .def_readwrite("elementwise", &pp::LayerTraits::elementwise)
      .def_readwrite("embedding_bytes", &pp::LayerTraits::embedding_bytes)
      .def_readwrite("embedding_row_bytes", &pp::LayerTraits::embedding_row_bytes);

  py::class_<pp::Layer>(pipeline, "Layer")
      .def(py::init([](std::string name, std::function<pp::Tensors(const pp::Tensors&)> forward,
                       pp::Tensors parameters, std::vector<std::string> parameter_names) {
             return pp::Layer{std::move(name), std::move(forward), std::move(parameters), std::move(parameter_names),
                              pp::LayerTraits{}};
           }),
           py::arg("name"), py::arg("forward"), py::arg("parameters"),
           py::arg("parameter_names") = std::vector<std::string>{})
      .def_readonly("name", &pp::Layer::name)
      .def_readonly("parameters", &pp::Layer::parameters)
      .def_readonly("parameter_names", &pp::Layer::parameter_names)
      .def_readwrite("traits", &pp::Layer::traits)
      .def_readonly("accumulates_weight_gradient", &pp::Layer::accumulates_weight_gradient)
      .def("__call__", [](const pp::Layer& layer, const pp::Tensors& inputs) { return layer.forward(inputs); },
           py::arg("inputs"));
  pipeline.def(
      "linear_layer",
      [](std::string name, at::Tensor weight, std::optional<at::Tensor> bias) {
        return pp::linear_layer(name, std::move(weight), bias.value_or(at::Tensor()));
      },
      py::arg("name"), py::arg("weight"), py::arg("bias"));

  pipeline.def(
      "shared_parameters_of",
      [](const std::vector<pp::Layer>& layers, const PySharedGroups& declared) {
        return to_python(pp::shared_parameters_of(layers, from_python(declared)));
      },
      py::arg("layers"), py::arg("declared"));

  py::class_<pp::Pipeline>(pipeline, "Pipeline", py::release_gil_before_calling_cpp_dtor())
      .def(py::init([](std::vector<pp::LayerFactory> factories, pp::LossFn loss,
                       c10::intrusive_ptr<c10d::ProcessGroup> process_group,
                       c10::intrusive_ptr<c10d::ProcessGroup> data_parallel_group, const std::string& schedule,
                       int microbatches, int virtual_stages, std::vector<int64_t> balance,
                       const std::string& balance_by, pp::Tensors sample_input, bool checkpoint_activations,
                       bool loss_on_all_ranks, double bucket_cap_mb, const PySharedGroups& shared_parameters) {
             return std::make_unique<pp::Pipeline>(std::move(factories), std::move(loss),
                                                   pp::PipelineOptions()
                                                       .process_group(std::move(process_group))
                                                       .data_parallel_group(std::move(data_parallel_group))
                                                       .schedule(schedule)
                                                       .microbatches(microbatches)
                                                       .virtual_stages(virtual_stages)
                                                       .balance(std::move(balance))
                                                       .balance_by(balance_by)
                                                       .sample_input(std::move(sample_input))
                                                       .checkpoint_activations(checkpoint_activations)
                                                       .loss_on_all_ranks(loss_on_all_ranks)
                                                       .bucket_cap_mb(bucket_cap_mb)
                                                       .shared_parameters(from_python(shared_parameters)));
           }),
           py::arg("factories"), py::arg("loss"), py::arg("process_group"), py::arg("data_parallel_group"),
           py::arg("schedule"), py::arg("microbatches"), py::arg("virtual_stages"), py::arg("balance"),
           py::arg("balance_by"), py::arg("sample_input"), py::arg("checkpoint_activations"),
           py::arg("loss_on_all_ranks"), py::arg("bucket_cap_mb"), py::arg("shared_parameters"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "step",
          [](pp::Pipeline& self, const pp::Tensors& inputs, const std::optional<at::Tensor>& target) {
            auto loss = self.step(inputs, target.value_or(at::Tensor()));
            return loss.defined() ? std::optional<at::Tensor>(loss) : std::nullopt;
          },
          py::arg("inputs"), py::arg("target"), py::call_guard<py::gil_scoped_release>())
      .def("forward", &pp::Pipeline::forward, py::arg("inputs"), py::call_guard<py::gil_scoped_release>())
      .def("parameters", &pp::Pipeline::parameters)
      .def("stages", &pp::Pipeline::stages)
      .def("has_last_stage", &pp::Pipeline::has_last_stage)
      .def_property_readonly("balance", &pp::Pipeline::balance)
      .def_property_readonly("partition_report", &pp::Pipeline::partition_report)
      .def_property_readonly("shared_parameters",
                             [](const pp::Pipeline& self) { return to_python(self.shared_parameters()); })
      .def_property_readonly("shared_parameters_report", &pp::Pipeline::shared_parameters_report)
      .def_property_readonly("actions", &pp::Pipeline::actions)
      .def_property_readonly("last_step_timeline", &pp::Pipeline::last_step_timeline)
      .def_property_readonly("last_step_milliseconds", &pp::Pipeline::last_step_milliseconds)
      .def_property_readonly("last_step_waiting_milliseconds", &pp::Pipeline::last_step_waiting_milliseconds);
}

} // namespace torchpar::bindings
