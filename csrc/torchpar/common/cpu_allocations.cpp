#include <torchpar/common/cpu_allocations.h>

#include <torchpar/common/cpu_block_cache.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace torchpar {
namespace {

// Keeps LibTorch's own allocator underneath (its alignment, its memory-profiler reports) and the DataPtr's context
// equal to its data, as the default allocator's, so raw_allocate/raw_deallocate keep working; the size of each
// live allocation, and the cache it came from, is kept by address for its release. Large blocks come from the
// block caches once there are some: one for blocks under kLargeBlock (activations, biases' gradients) and one for
// the rest, as the CUDA caching allocator keeps a small and a large pool — a small block that lives long (an
// activation kept for backward) would otherwise split a large free block that the next large request then needs
// whole, and pages would be moved every step.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* underlying) : underlying_(underlying) {}

  c10::DataPtr allocate(size_t bytes) override {
    void* data = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (auto* cache = cache_for(bytes)) {
        data = cache->take(bytes);
        TORCH_CHECK(data != nullptr, "torchpar's CPU allocator: the system maps no more memory for a block of ",
                    bytes, " bytes (", counts_.reserved, " bytes mapped for tensors, all in use)");
        record(data, bytes, cache);
      }
    }
    if (data == nullptr) {
      data = underlying_->raw_allocate(bytes);
      if (data != nullptr) {
        std::lock_guard<std::mutex> lock(mutex_);
        record(data, bytes, nullptr);
      }
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* destination, const void* source, std::size_t count) const override {
    default_copy_data(destination, source, count);
  }

  void keep_freed_blocks(size_t most_kept_free) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (caches_[0]) {
      for (auto& cache : caches_) cache->keep_at_most(most_kept_free);
    } else {
      caches_[0] = std::make_unique<CpuBlockCache>(kSmallestKeptBlock, kLargeBlock, most_kept_free);
      caches_[1] = std::make_unique<CpuBlockCache>(kLargeBlock, std::numeric_limits<size_t>::max(), most_kept_free);
    }
    note_reserved();
  }

  bool keeps_freed_blocks() {
    std::lock_guard<std::mutex> lock(mutex_);
    return caches_[0] != nullptr;
  }

  void release_free_blocks() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& cache : caches_) {
      if (cache) cache->release_free_blocks();
    }
    note_reserved();
  }

  CpuAllocations counts() {
    std::lock_guard<std::mutex> lock(mutex_);
    return counts_;
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    counts_.peak = counts_.current;
    counts_.peak_reserved = counts_.reserved;
  }

 private:
  static void release(void* data);

  // Under mutex_.
  CpuBlockCache* cache_for(size_t bytes) {
    for (auto& cache : caches_) {
      if (cache && cache->serves(bytes)) return cache.get();
    }
    return nullptr;
  }

  void record(void* data, size_t bytes, CpuBlockCache* cache) {
    live_[data] = {bytes, cache};
    counts_.current += static_cast<int64_t>(bytes);
    counts_.peak = std::max(counts_.peak, counts_.current);
    note_reserved();
  }

  void note_reserved() {
    counts_.reserved = 0;
    for (auto& cache : caches_) counts_.reserved += cache ? cache->reserved_bytes() : 0;
    counts_.peak_reserved = std::max(counts_.peak_reserved, counts_.reserved);
  }

  c10::Allocator* underlying_;
  std::mutex mutex_;
  struct Live {
    size_t bytes;
    CpuBlockCache* cache;  // the cache it came from; nullptr: LibTorch's allocator underneath
  };
  std::unordered_map<void*, Live> live_;
  std::array<std::unique_ptr<CpuBlockCache>, 2> caches_;  // blocks under kLargeBlock, and the rest
  CpuAllocations counts_;
};

std::mutex install_mutex;
// Never freed: tensors may be released through it at exit. Atomic: any thread may release a tensor.
std::atomic<CountingCpuAllocator*> installed{nullptr};

void CountingCpuAllocator::release(void* data) {
  if (data == nullptr) return;
  auto* counter = installed.load(std::memory_order_acquire);
  {
    std::lock_guard<std::mutex> lock(counter->mutex_);
    const auto found = counter->live_.find(data);
    if (found != counter->live_.end()) {
      const Live live = found->second;
      counter->counts_.current -= static_cast<int64_t>(live.bytes);
      counter->live_.erase(found);
      if (live.cache != nullptr) {
        live.cache->give_back(data);
        counter->note_reserved();
        return;
      }
    }
  }
  counter->underlying_->raw_deallocate(data);
}

CountingCpuAllocator& installed_counter(const char* caller) {
  auto* counter = installed.load(std::memory_order_acquire);
  TORCH_CHECK(counter != nullptr, caller, ": call count_cpu_allocations() first");
  return *counter;
}

} // namespace

void count_cpu_allocations() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (installed.load() != nullptr) return;
  auto* underlying = c10::GetCPUAllocator();
  TORCH_CHECK(underlying->raw_deleter() != nullptr, "count_cpu_allocations: LibTorch's CPU allocator has no raw "
              "interface to allocate through");
  auto* counter = new CountingCpuAllocator(underlying);
  installed.store(counter, std::memory_order_release);  // before any tensor can be released through it
  c10::SetCPUAllocator(counter, /*priority=*/UINT8_MAX);
  if (c10::GetCPUAllocator() != counter) {  // another allocator of the highest priority: nothing went through ours
    installed.store(nullptr);
    TORCH_CHECK(false, "count_cpu_allocations: LibTorch kept its CPU allocator");
  }
}

bool counting_cpu_allocations() {
  return installed.load(std::memory_order_acquire) != nullptr;
}

CpuAllocations cpu_allocations() {
  return installed_counter("cpu_allocations").counts();
}

void reset_cpu_allocation_peak() {
  installed_counter("reset_cpu_allocation_peak").reset_peak();
}

void keep_freed_memory(size_t most_kept_free) {
  count_cpu_allocations();
  installed_counter("keep_freed_memory").keep_freed_blocks(most_kept_free);
}

bool keeping_freed_memory() {
  auto* counter = installed.load(std::memory_order_acquire);
  return counter != nullptr && counter->keeps_freed_blocks();
}

void release_freed_memory() {
  if (auto* counter = installed.load(std::memory_order_acquire)) counter->release_free_blocks();
}

} // namespace torchpar
