#pragma once
#include <pybind11/pybind11.h>

namespace torchpar::bindings {

// Classes that own process groups or threads are bound with py::release_gil_before_calling_cpp_dtor():
// their destructors join threads (Gloo's workers, the parameter server's channels) that may be dropping
// the last reference to a Python tensor, which needs the GIL; destroyed while holding it, they deadlock.

// One function per subsystem, each in its own file; module.cpp calls them all.
void bind_checkpoint(pybind11::module_& module);
void bind_comm(pybind11::module_& module);
void bind_ddp(pybind11::module_& module);
void bind_memory(pybind11::module_& module);
void bind_pipeline(pybind11::module_& module);
void bind_plan(pybind11::module_& module);
void bind_ps(pybind11::module_& module);
void bind_sharded(pybind11::module_& module);
void bind_tensor_parallel(pybind11::module_& module);

} // namespace torchpar::bindings
