// torchpar._C.ddp: the C++ DistributedDataParallel engine under python/torchpar/ddp.py.
#include <torchpar/bindings/bindings.h>

#include <torchpar/ddp/comm_hooks.h>
#include <torchpar/ddp/powersgd_hook.h>
#include <torchpar/ddp/reducer.h>
#include <torchpar/ddp/replica_coordinator.h>
#include <torchpar/ddp/timeline.h>

#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/utils/pybind.h>

namespace torchpar::bindings {

namespace py = pybind11;
using torchpar::ddp::ReplicaCoordinator;

void bind_ddp(py::module_& module) {
  auto ddp = module.def_submodule("ddp", "C++ DistributedDataParallel engine");
  py::class_<ReplicaCoordinator>(ddp, "ReplicaCoordinator", py::release_gil_before_calling_cpp_dtor())
      .def(
          py::init([](ddp::NamedTensors parameters, ddp::NamedTensors buffers,
                      c10::intrusive_ptr<c10d::ProcessGroup> process_group, double bucket_cap_mb,
                      double first_bucket_cap_mb, std::vector<double> bucket_cap_mb_list, bool find_unused_parameters,
                      bool gradient_as_bucket_view, bool broadcast_buffers, bool static_graph, bool init_sync,
                      bool init_sync_buffers,
                      std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> data_process_group) {
            return std::make_unique<ReplicaCoordinator>(
                std::move(parameters), std::move(buffers),
                ddp::DistributedDataParallelOptions()
                    .process_group(std::move(process_group))
                    .bucket_cap_mb(bucket_cap_mb)
                    .first_bucket_cap_mb(first_bucket_cap_mb)
                    .bucket_cap_mb_list(std::move(bucket_cap_mb_list))
                    .find_unused_parameters(find_unused_parameters)
                    .gradient_as_bucket_view(gradient_as_bucket_view)
                    .broadcast_buffers(broadcast_buffers)
                    .static_graph(static_graph)
                    .init_sync(init_sync)
                    .init_sync_buffers(init_sync_buffers)
                    .data_process_group(data_process_group.value_or(nullptr)));
          }),
          py::arg("parameters"), py::arg("buffers"), py::arg("process_group"), py::arg("bucket_cap_mb"),
          py::arg("first_bucket_cap_mb"), py::arg("bucket_cap_mb_list"), py::arg("find_unused_parameters"),
          py::arg("gradient_as_bucket_view"), py::arg("broadcast_buffers"), py::arg("static_graph"),
          py::arg("init_sync"), py::arg("init_sync_buffers"), py::arg("data_process_group") = py::none(),
          py::call_guard<py::gil_scoped_release>())
      .def("pre_forward", &ReplicaCoordinator::pre_forward, py::arg("will_sync"),
           py::call_guard<py::gil_scoped_release>())
      .def("post_forward", &ReplicaCoordinator::post_forward, py::arg("outputs"), py::arg("will_sync"),
           py::call_guard<py::gil_scoped_release>())
      .def_property("grad_sync", &ReplicaCoordinator::grad_sync, &ReplicaCoordinator::set_grad_sync)
      .def("begin_join", &ReplicaCoordinator::begin_join, py::arg("divide_by_initial_world_size"))
      .def_property_readonly("joining", &ReplicaCoordinator::joining)
      .def("shadow_iteration", &ReplicaCoordinator::shadow_iteration, py::call_guard<py::gil_scoped_release>())
      .def("synchronise_final_model", &ReplicaCoordinator::synchronise_final_model,
           py::call_guard<py::gil_scoped_release>())
      .def("set_static_graph", &ReplicaCoordinator::set_static_graph)
      .def(
          "register_comm_hook",
          [](ReplicaCoordinator& self, py::object state, py::object hook) {
            self.register_comm_hook(std::make_unique<c10d::PythonCommHook>(std::move(state), std::move(hook)));
          },
          py::arg("state"), py::arg("hook"))
      .def(
          "register_builtin_comm_hook",
          [](ReplicaCoordinator& self, const std::string& name,
             c10::intrusive_ptr<c10d::ProcessGroup> process_group) {
            self.register_comm_hook(ddp::builtin_comm_hook(name, self.comm_hook_group(std::move(process_group))));
          },
          py::arg("name"), py::arg("process_group"))
      .def(
          "register_powersgd_hook",
          [](ReplicaCoordinator& self, c10::intrusive_ptr<c10d::ProcessGroup> process_group,
             int64_t matrix_approximation_rank, int64_t start_powerSGD_iter, double min_compression_rate,
             bool use_error_feedback, bool warm_start, uint64_t seed) {
            self.register_comm_hook(std::make_unique<ddp::PowerSGDHook>(
                self.comm_hook_group(std::move(process_group)),
                ddp::PowerSGDOptions()
                    .matrix_approximation_rank(matrix_approximation_rank)
                    .start_powerSGD_iter(start_powerSGD_iter)
                    .min_compression_rate(min_compression_rate)
                    .use_error_feedback(use_error_feedback)
                    .warm_start(warm_start)
                    .seed(seed)));
          },
          py::arg("process_group"), py::arg("matrix_approximation_rank"), py::arg("start_powerSGD_iter"),
          py::arg("min_compression_rate"), py::arg("use_error_feedback"), py::arg("warm_start"), py::arg("seed"))
      .def("bucket_indices", [](ReplicaCoordinator& self) { return self.reducer().bucket_indices(); })
      .def_property_readonly("buckets_rebuilt",
                             [](ReplicaCoordinator& self) { return self.reducer().buckets_rebuilt(); })
      .def_property_readonly("gradients_reduced_in_place",
                             [](ReplicaCoordinator& self) { return self.reducer().reducing_in_place(); })
      .def_property_readonly("timeline_path", [](ReplicaCoordinator& self) -> std::optional<std::string> {
        if (!self.timeline()) {
          return std::nullopt;
        }
        return self.timeline()->path();
      });
}

} // namespace torchpar::bindings
