// The bytes of CPU tensor memory alive now and at most since the last reset: CPU's counterpart of
// torch.cuda.memory_allocated / max_memory_allocated, which LibTorch does not keep for CPU tensors. Counted by an
// allocator wrapped around LibTorch's CPU allocator once count_cpu_allocations() installs it (tensors allocated
// before are not counted, nor their release). For measuring what a rank holds (benchmarks, --verify, tests).
#pragma once
#include <cstdint>

namespace torchpar {

struct CpuAllocations {
  int64_t current = 0;  // bytes allocated through the counter and not yet freed
  int64_t peak = 0;     // the most `current` was since installation or the last reset_cpu_allocation_peak()
};

// Installs the counter as LibTorch's CPU allocator (idempotent; thread-safe). Throws if another allocator was
// installed with a higher priority, which it would not replace.
void count_cpu_allocations();
bool counting_cpu_allocations();
CpuAllocations cpu_allocations();
// The peak set to the current bytes.
void reset_cpu_allocation_peak();

} // namespace torchpar
