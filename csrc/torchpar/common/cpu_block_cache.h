// Large CPU blocks mapped by torchpar and kept once freed, instead of glibc's heap. A training step frees and
// re-makes its blocks every step (gradients, gathered units, flat buckets, activations, the optimizer's
// temporaries). glibc either maps each afresh and faults it in page by page (its default: the sharded engine's
// steps 1.2x slower here, 3x with every block mapped) or, keeping freed memory, lets blocks of other sizes fall
// between the freed ones so that its heap grows step after step (the sharded engine's stage 3: 2-3x its tensors'
// peak after 400 steps, still growing).
//
// Here a request takes the smallest free block that holds it (split when much larger; the pieces join again once
// both are free, so a large block split for smaller ones is whole again for the next large one); where none does,
// free blocks' pages are moved under a fresh mapping (mremap: page tables move, nothing is copied or faulted) and
// only what they lack is new. So the pages mapped follow the tensors' own peak, not the sizes' history, and a step
// faults nothing in once the first steps mapped its peak. The CUDA caching allocator's idea, with the kernel's
// page tables doing what its block splitting cannot on a GPU. Not thread-safe: its owner locks.
#pragma once
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <unordered_map>

namespace torchpar {

class CpuBlockCache {
 public:
  // Blocks of `smallest_block` bytes up to (not including) `largest_block` are served here; once more than
  // `most_kept_free` bytes of blocks are free, the least recently freed go back to the system.
  CpuBlockCache(size_t smallest_block, size_t largest_block, size_t most_kept_free);
  CpuBlockCache(const CpuBlockCache&) = delete;
  CpuBlockCache& operator=(const CpuBlockCache&) = delete;

  bool serves(size_t bytes) const { return bytes >= smallest_block_ && bytes < largest_block_; }
  // A page-aligned block of at least `bytes`, or nullptr where the system maps no more even after every free
  // block went back.
  void* take(size_t bytes);
  // False: `data` is not a block of this cache (nothing done).
  bool give_back(void* data);
  // Every free block back to the system.
  void release_free_blocks();
  // A new limit on the free blocks kept, applied at once.
  void keep_at_most(size_t most_kept_free);

  int64_t reserved_bytes() const { return reserved_; }  // mapped: in use and free
  int64_t free_bytes() const { return free_; }

 private:
  // A block is carved from one mapping (its segment): only blocks of one segment join, as only they are
  // contiguous pages the kernel mapped together.
  struct Block {
    char* data;
    size_t bytes;
    uint64_t segment;
  };
  using FreeList = std::list<Block>;  // least recently freed first

  void* take_free(size_t bytes);      // from the smallest free block that holds it; nullptr: none does
  void* map_moving_free(size_t bytes);  // a fresh mapping, as much of it as free blocks cover moved from them
  void add_free(Block block);  // joined with free neighbours of its segment
  Block remove_free(FreeList::iterator block);
  void trim_to(size_t most_free);  // the least recently freed blocks unmapped until at most most_free are free

  size_t smallest_block_;
  size_t largest_block_;
  size_t most_kept_free_;
  FreeList free_blocks_;
  std::multimap<size_t, FreeList::iterator> free_by_size_;
  std::map<char*, FreeList::iterator> free_by_address_;
  std::unordered_map<void*, Block> in_use_;
  uint64_t segments_ = 0;
  int64_t reserved_ = 0;
  int64_t free_ = 0;
};

} // namespace torchpar
