#pragma once
#include <pybind11/pybind11.h>

namespace torchpar::bindings {

// One function per subsystem, each in its own file; module.cpp calls them all.
void bind_checkpoint(pybind11::module_& module);
void bind_comm(pybind11::module_& module);
void bind_ddp(pybind11::module_& module);
void bind_pipeline(pybind11::module_& module);
void bind_ps(pybind11::module_& module);
void bind_tensor_parallel(pybind11::module_& module);

} // namespace torchpar::bindings
