// torchpar._C.Checkpointer: the crash-safe checkpoint folders under python/torchpar/checkpoint.py.
#include <torchpar/bindings/bindings.h>

#include <torchpar/common/checkpointer.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

namespace torchpar::bindings {

namespace py = pybind11;

void bind_checkpoint(py::module_& module) {
  py::class_<Checkpointer>(module, "Checkpointer")
      .def(py::init([](std::string directory, c10::intrusive_ptr<c10d::ProcessGroup> group, int keep,
                       std::string control_device) {
             return std::make_unique<Checkpointer>(
                 std::move(directory), std::move(group),
                 CheckpointerOptions().keep(keep).control_device(c10::Device(control_device)));
           }),
           py::arg("directory"), py::arg("group"), py::arg("keep"), py::arg("control_device"))
      .def(
          "save_bytes",
          [](Checkpointer& self, int64_t step, const py::bytes& state) {
            std::string bytes = state;  // copied while the GIL is held
            py::gil_scoped_release released;
            self.save_bytes(step, bytes);
          },
          py::arg("step"), py::arg("state"))
      .def(
          "load_bytes",
          [](const Checkpointer& self, int64_t step) {
            std::string bytes;
            {
              py::gil_scoped_release released;
              bytes = self.load_bytes(step);
            }
            return py::bytes(bytes);
          },
          py::arg("step"))
      .def("latest_step", &Checkpointer::latest_step, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("directory", &Checkpointer::directory);
}

} // namespace torchpar::bindings
