// torchpar._C.sharded: the C++ sharded data parallelism engine under python/torchpar/sharded.py.
#include <torchpar/bindings/bindings.h>

#include <torchpar/sharded/sharded_coordinator.h>

#include <torch/csrc/utils/pybind.h>

#include <tuple>

namespace torchpar::bindings {

namespace py = pybind11;
using torchpar::sharded::ShardedCoordinator;

void bind_sharded(py::module_& module) {
  auto sharded = module.def_submodule("sharded", "C++ sharded data parallelism engine (ZeRO stages 1 and 2)");
  py::class_<ShardedCoordinator>(sharded, "ShardedCoordinator", py::release_gil_before_calling_cpp_dtor())
      .def(py::init([](NamedTensors parameters, NamedTensors buffers,
                       c10::intrusive_ptr<c10d::ProcessGroup> process_group, int stage, double bucket_cap_mb,
                       bool broadcast_buffers, std::optional<at::ScalarType> param_dtype,
                       std::optional<at::ScalarType> reduce_dtype, std::vector<std::string> units,
                       bool reshard_after_forward, std::optional<bool> prefetch) {
             return std::make_unique<ShardedCoordinator>(std::move(parameters), std::move(buffers),
                                                         sharded::ShardedOptions()
                                                             .process_group(std::move(process_group))
                                                             .stage(stage)
                                                             .bucket_cap_mb(bucket_cap_mb)
                                                             .broadcast_buffers(broadcast_buffers)
                                                             .param_dtype(param_dtype)
                                                             .reduce_dtype(reduce_dtype)
                                                             .units(std::move(units))
                                                             .reshard_after_forward(reshard_after_forward)
                                                             .prefetch(prefetch));
           }),
           py::arg("parameters"), py::arg("buffers"), py::arg("process_group"), py::arg("stage"),
           py::arg("bucket_cap_mb"), py::arg("broadcast_buffers"), py::arg("param_dtype") = py::none(),
           py::arg("reduce_dtype") = py::none(), py::arg("units") = std::vector<std::string>{},
           py::arg("reshard_after_forward") = true, py::arg("prefetch") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("shard", &ShardedCoordinator::shard)
      .def_property_readonly("stage", &ShardedCoordinator::stage)
      .def_property("grad_sync", &ShardedCoordinator::grad_sync, &ShardedCoordinator::set_grad_sync)
      .def("will_sync", &ShardedCoordinator::will_sync)
      .def("pre_forward", &ShardedCoordinator::pre_forward, py::arg("will_sync"),
           py::call_guard<py::gil_scoped_release>())
      .def("reduce_gradients", &ShardedCoordinator::reduce_gradients, py::call_guard<py::gil_scoped_release>())
      .def("gather_parameters", &ShardedCoordinator::gather_parameters, py::call_guard<py::gil_scoped_release>())
      .def("clip_grad_norm", &ShardedCoordinator::clip_grad_norm, py::arg("max_norm"), py::arg("norm_type") = 2.0,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("parameter_names", &ShardedCoordinator::parameter_names)
      .def(
          "shard_members",
          [](const ShardedCoordinator& c, size_t shard) {
            std::vector<size_t> members;
            for (const auto& bucket : c.layout().buckets) {
              if (bucket.dtype != c.layout().shards.at(shard).first) continue;
              for (const auto& slot : bucket.slots) members.push_back(slot.parameter);
            }
            return members;
          },
          py::arg("shard"), "the parameters (indices) whose elements shard `shard` holds a piece of")
      .def("gather_full", &ShardedCoordinator::gather_full, py::arg("shard"), py::arg("shard_like"),
           py::call_guard<py::gil_scoped_release>())
      .def("shard_of", &ShardedCoordinator::shard_of, py::arg("shard"), py::arg("full"))
      .def(
          "shard_pieces",
          [](const ShardedCoordinator& c, size_t shard) {
            std::vector<std::tuple<size_t, int64_t, int64_t, int64_t>> pieces;
            for (const auto& piece : sharded::pieces_of(c.layout(), shard, c.rank())) {
              pieces.emplace_back(piece.parameter, piece.parameter_offset, piece.shard_offset, piece.numel);
            }
            return pieces;
          },
          py::arg("shard"),
          "this rank's pieces in shard `shard`: (parameter index, first element in the flattened parameter, "
          "offset in the shard, elements)")
      .def_property_readonly("unit_count", &ShardedCoordinator::unit_count)
      .def("before_unit_forward", &ShardedCoordinator::before_unit_forward, py::arg("unit"),
           py::call_guard<py::gil_scoped_release>())
      .def("after_unit_forward", &ShardedCoordinator::after_unit_forward, py::arg("unit"),
           py::call_guard<py::gil_scoped_release>())
      .def("before_unit_backward", &ShardedCoordinator::before_unit_backward, py::arg("unit"),
           py::call_guard<py::gil_scoped_release>())
      .def("unit_of", &ShardedCoordinator::unit_of, py::arg("parameter"), "its unit, as errors name it")
      .def("parameter_gathered", &ShardedCoordinator::parameter_gathered, py::arg("parameter"))
      .def("gather_all", &ShardedCoordinator::gather_all, py::call_guard<py::gil_scoped_release>())
      .def("release_all", &ShardedCoordinator::release_all, py::call_guard<py::gil_scoped_release>())
      .def("zero_parameter_gradients", &ShardedCoordinator::zero_parameter_gradients)
      .def_property_readonly("bytes_sent_last_step", &ShardedCoordinator::bytes_sent_last_step)
      .def_property_readonly("reduce_scatter_bytes",
                             [](const ShardedCoordinator& c) { return c.layout().reduce_scatter_bytes(); });
}

} // namespace torchpar::bindings
