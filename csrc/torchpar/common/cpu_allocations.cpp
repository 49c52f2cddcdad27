#include <torchpar/common/cpu_allocations.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace torchpar {
namespace {

// Keeps LibTorch's own allocator underneath (its alignment, its memory-profiler reports) and the DataPtr's context
// equal to its data, as the default allocator's, so raw_allocate/raw_deallocate keep working; the size of each
// live allocation is kept by address for its release.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* underlying) : underlying_(underlying) {}

  c10::DataPtr allocate(size_t bytes) override {
    void* data = underlying_->raw_allocate(bytes);
    if (data != nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[data] = bytes;
      counts_.current += static_cast<int64_t>(bytes);
      counts_.peak = std::max(counts_.peak, counts_.current);
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* destination, const void* source, std::size_t count) const override {
    default_copy_data(destination, source, count);
  }

  CpuAllocations counts() {
    std::lock_guard<std::mutex> lock(mutex_);
    return counts_;
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    counts_.peak = counts_.current;
  }

 private:
  static void release(void* data);

  c10::Allocator* underlying_;
  std::mutex mutex_;
  std::unordered_map<void*, size_t> sizes_;
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
    const auto found = counter->sizes_.find(data);
    if (found != counter->sizes_.end()) {
      counter->counts_.current -= static_cast<int64_t>(found->second);
      counter->sizes_.erase(found);
    }
  }
  counter->underlying_->raw_deallocate(data);
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
  auto* counter = installed.load(std::memory_order_acquire);
  TORCH_CHECK(counter != nullptr, "cpu_allocations: call count_cpu_allocations() first");
  return counter->counts();
}

void reset_cpu_allocation_peak() {
  auto* counter = installed.load(std::memory_order_acquire);
  TORCH_CHECK(counter != nullptr, "reset_cpu_allocation_peak: call count_cpu_allocations() first");
  counter->reset_peak();
}

} // namespace torchpar
