// The bytes of CPU tensor memory alive now and at most since the last reset: CPU's counterpart of
// torch.cuda.memory_allocated / max_memory_allocated, which LibTorch does not keep for CPU tensors. Counted by an
// allocator wrapped around LibTorch's CPU allocator once count_cpu_allocations() installs it (tensors allocated
// before are not counted, nor their release). For measuring what a rank holds (benchmarks, --verify, tests).
// The same allocator keeps freed blocks for reuse once keep_freed_memory() asks it to (common/cpu_block_cache.h).
#pragma once
#include <cstddef>
#include <cstdint>

namespace torchpar {

struct CpuAllocations {
  int64_t current = 0;  // bytes allocated through the counter and not yet freed
  int64_t peak = 0;     // the most `current` was since installation or the last reset_cpu_allocation_peak()
  // Bytes the block cache maps, its free blocks included (0 without keep_freed_memory), now and at most since the
  // same reset: the resident set's share of tensors, as torch.cuda.memory_reserved is the GPU's.
  int64_t reserved = 0;
  int64_t peak_reserved = 0;
};

// CPU tensor blocks of kSmallestKeptBlock bytes and more are mapped by torchpar and kept when freed for the next
// block of their size (up to `most_kept_free` bytes of free blocks under 1 MiB and as much of larger ones; beyond,
// the least recently freed go back to the system), so a training step faults nothing back in and the resident set
// stops growing after the first steps. Installs the counter too; blocks allocated before are released as they were
// made. Idempotent: a second call only changes `most_kept_free`.
constexpr size_t kSmallestKeptBlock = 128 << 10;  // glibc's own threshold for mapping a block apart
constexpr size_t kLargeBlock = 1 << 20;           // blocks under it and the others are kept apart
void keep_freed_memory(size_t most_kept_free = size_t{256} << 20);
bool keeping_freed_memory();
// Every free kept block back to the system (torch.cuda.empty_cache's counterpart).
void release_freed_memory();

// Installs the counter as LibTorch's CPU allocator (idempotent; thread-safe). Throws if another allocator was
// installed with a higher priority, which it would not replace.
void count_cpu_allocations();
bool counting_cpu_allocations();
CpuAllocations cpu_allocations();
// The peak set to the current bytes.
void reset_cpu_allocation_peak();

} // namespace torchpar
