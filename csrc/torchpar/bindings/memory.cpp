// torchpar._C.memory: the CPU allocation counter and block cache (common/cpu_allocations.h) under python/torchpar/allocator.py.
#include <torchpar/bindings/bindings.h>

#include <torchpar/common/cpu_allocations.h>

namespace torchpar::bindings {

namespace py = pybind11;

void bind_memory(py::module_& module) {
  auto memory = module.def_submodule("memory", "bytes of CPU tensor memory, counted");
  memory.def("count_cpu_allocations", &count_cpu_allocations);
  memory.def("counting_cpu_allocations", &counting_cpu_allocations);
  memory.def("cpu_allocations", [] {
    const auto counts = cpu_allocations();
    return py::make_tuple(counts.current, counts.peak, counts.reserved, counts.peak_reserved);
  });
  memory.def("reset_cpu_allocation_peak", &reset_cpu_allocation_peak);
  memory.def("keep_freed_memory", &keep_freed_memory, py::arg("most_kept_free"));
  memory.def("keeping_freed_memory", &keeping_freed_memory);
  memory.def("release_freed_memory", &release_freed_memory);
  memory.attr("SMALLEST_KEPT_BLOCK") = kSmallestKeptBlock;
}

} // namespace torchpar::bindings
