// torchpar._C. pybind11 is torch's bundled copy, so the c10d objects it returns (Store,
// ProcessGroup) are the very Python types of torch.distributed.
#include <torch/csrc/utils/pybind.h>

#include <torchpar/bindings/bindings.h>

PYBIND11_MODULE(_C, module) {
  module.doc() = "torchpar's C++ engine; use the torchpar package, not this module";
  // c10::Error reaches Python as RuntimeError carrying the message without the C++ backtrace.
  pybind11::register_local_exception_translator([](std::exception_ptr error) {
    try {
      if (error) {
        std::rethrow_exception(error);
      }
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });
  torchpar::bindings::bind_checkpoint(module);
  torchpar::bindings::bind_comm(module);
  torchpar::bindings::bind_ddp(module);
  torchpar::bindings::bind_memory(module);
  torchpar::bindings::bind_pipeline(module);
  torchpar::bindings::bind_plan(module);
  torchpar::bindings::bind_ps(module);
  torchpar::bindings::bind_sharded(module);
  torchpar::bindings::bind_tensor_parallel(module);
}
