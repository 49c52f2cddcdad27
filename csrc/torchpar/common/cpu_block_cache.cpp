#include <torchpar/common/cpu_block_cache.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

namespace torchpar {
namespace {

size_t page_size() {
  static const auto bytes = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return bytes;
}

size_t whole_pages(size_t bytes) {
  const size_t page = page_size();
  return (bytes + page - 1) / page * page;
}

char* map(size_t bytes) {
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return data == MAP_FAILED ? nullptr : static_cast<char*>(data);
}

} // namespace

CpuBlockCache::CpuBlockCache(size_t smallest_block, size_t largest_block, size_t most_kept_free)
    : smallest_block_(smallest_block), largest_block_(largest_block), most_kept_free_(most_kept_free) {}

void* CpuBlockCache::take(size_t bytes) {
  const size_t wanted = whole_pages(bytes);
  if (void* data = take_free(wanted)) return data;
  void* data = map_moving_free(wanted);
  if (data == nullptr && !free_blocks_.empty()) {
    release_free_blocks();
    data = map_moving_free(wanted);
  }
  return data;
}

void* CpuBlockCache::take_free(size_t bytes) {
  const auto fit = free_by_size_.lower_bound(bytes);
  if (fit == free_by_size_.end()) return nullptr;
  auto block = remove_free(fit->second);
  // A remainder too small to serve a block of its own stays with the block.
  if (block.bytes - bytes >= smallest_block_) {
    add_free({block.data + bytes, block.bytes - bytes, block.segment});
    block.bytes = bytes;
  }
  in_use_.emplace(block.data, block);
  return block.data;
}

void* CpuBlockCache::map_moving_free(size_t bytes) {
  char* data = map(bytes);
  if (data == nullptr) return nullptr;
  reserved_ += static_cast<int64_t>(bytes);
  // The largest free blocks first: the fewest moves. Each move replaces fresh (untouched) pages of the mapping by
  // pages already resident, and unmaps them where they were.
  size_t filled = 0;
  while (filled < bytes && !free_by_size_.empty()) {
    const auto largest = remove_free(std::prev(free_by_size_.end())->second);
    const size_t moved = std::min(largest.bytes, bytes - filled);
    // It fails where the pages span two of the kernel's areas (a block joined from moved pieces): then they stay.
    if (mremap(largest.data, moved, moved, MREMAP_MAYMOVE | MREMAP_FIXED, data + filled) == MAP_FAILED) {
      add_free(largest);
      break;
    }
    reserved_ -= static_cast<int64_t>(moved);
    if (moved < largest.bytes) add_free({largest.data + moved, largest.bytes - moved, largest.segment});
    filled += moved;
  }
  in_use_.emplace(data, Block{data, bytes, ++segments_});
  return data;
}

bool CpuBlockCache::give_back(void* data) {
  const auto found = in_use_.find(data);
  if (found == in_use_.end()) return false;
  const Block block = found->second;
  in_use_.erase(found);
  add_free(block);
  trim_to(most_kept_free_);
  return true;
}

void CpuBlockCache::release_free_blocks() {
  trim_to(0);
}

void CpuBlockCache::keep_at_most(size_t most_kept_free) {
  most_kept_free_ = most_kept_free;
  trim_to(most_kept_free_);
}

void CpuBlockCache::add_free(Block block) {
  const auto after = free_by_address_.find(block.data + block.bytes);
  if (after != free_by_address_.end() && after->second->segment == block.segment) {
    block.bytes += remove_free(after->second).bytes;
  }
  const auto next = free_by_address_.lower_bound(block.data);
  if (next != free_by_address_.begin()) {
    const auto before = std::prev(next)->second;
    if (before->segment == block.segment && before->data + before->bytes == block.data) {
      const auto joined = remove_free(before);
      block = {joined.data, joined.bytes + block.bytes, block.segment};
    }
  }
  free_blocks_.push_back(block);
  const auto entry = std::prev(free_blocks_.end());
  free_by_size_.emplace(block.bytes, entry);
  free_by_address_.emplace(block.data, entry);
  free_ += static_cast<int64_t>(block.bytes);
}

CpuBlockCache::Block CpuBlockCache::remove_free(FreeList::iterator block) {
  auto [first, last] = free_by_size_.equal_range(block->bytes);
  for (auto entry = first; entry != last; ++entry) {
    if (entry->second == block) {
      free_by_size_.erase(entry);
      break;
    }
  }
  free_by_address_.erase(block->data);
  const Block removed = *block;
  free_blocks_.erase(block);
  free_ -= static_cast<int64_t>(removed.bytes);
  return removed;
}

void CpuBlockCache::trim_to(size_t most_free) {
  while (free_ > static_cast<int64_t>(most_free)) {
    const auto block = remove_free(free_blocks_.begin());
    munmap(block.data, block.bytes);
    reserved_ -= static_cast<int64_t>(block.bytes);
  }
}

} // namespace torchpar
