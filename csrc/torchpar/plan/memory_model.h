// What a rank holds, line by line: the cost model's memory per rank (cost_model.h) as a breakdown that
// `python -m torchpar.plan --explain-memory` prints and --verify compares with what it measured.
//
// Two views, as torchpar measures them (docs/planner.md, "Memory"): the tensors a rank allocates (the CPU
// allocator's count, torchpar/common/cpu_allocations.h: parameters, gradients, buckets, optimizer state,
// activations) and its resident set, which adds pages that are no tensor's: shared memory a rank maps (the
// pipeline's rings, the shm group's segment, the parameter server's rings), what glibc keeps of freed blocks
// under the project's allocator setting (torchpar.keep_freed_memory), and the process's own overhead.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace torchpar::plan {

struct MemoryLine {
  std::string what;
  int64_t bytes = 0;
  bool tensor = true;  // counted by the allocator; false: resident only
};

struct MemoryBreakdown {
  std::vector<MemoryLine> lines;
  // Appends a line (none for 0 bytes; the same `what` twice adds up).
  void add(const std::string& what, double bytes, bool tensor = true);
  int64_t tensor_bytes() const;
  int64_t total() const;
  // "  parameters                      12.0 MiB  tensors\n" ... and the totals.
  std::string render() const;
};

// What the host adds to a rank's resident set beyond its tensors.
struct HostMemory {
  // Measured on the ranks (plan's memory probe): a rank's resident growth, in a small DDP run, beyond its
  // tensors' peak and the lines below: its threads' stacks and arenas, the groups' buffers.
  int64_t process_overhead_bytes = 0;
  int64_t stage_ring_bytes = 0;  // each pipeline ring's capacity (0: no rings between stage ranks)
  int64_t shm_chunk_bytes = 0;   // the same-host shm group's slot, where the collectives go through one (0: none)
  // torchpar's CPU allocator keeps tensor blocks of 128 KiB and more once freed (keep_freed_memory, as the planner
  // and the code it recommends run; common/cpu_block_cache.h): their pages follow the tensors' peak, and only the
  // heap's small blocks add what the model's training in one process measured. Without it glibc's heap keeps
  // what it will, growing step after step (not predicted).
  bool keeps_freed_memory = false;
};

// Pages of one pipeline ring a rank maps that its traffic touches: a sender restarts at the ring's start
// whenever it finds it empty a quarter in (pipeline/same_host_rings.cpp), so a quarter of it plus what is in
// flight at once, at most all of it.
int64_t ring_pages(int64_t capacity, double in_flight_bytes);

// Pages of a same-host shm group's segment that ops of `largest_op_bytes` reach: rounds of one chunk per rank
// rotate over comm/shm/layout.h's buffer sets.
int64_t shm_segment_pages(int64_t chunk_bytes, int ranks, double largest_op_bytes);

// The lines every strategy's rank adds to its resident set: what the heap keeps beyond the tensors under
// keep_freed_memory (`retained_bytes`, cost_terms.h's heap_retained) and the process's overhead.
void add_host_lines(MemoryBreakdown& memory, const HostMemory& host, double retained_bytes);

} // namespace torchpar::plan
