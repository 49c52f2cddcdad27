#include "catch_with_torch.h"

#include <ATen/ops/empty.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include <torchpar/common/cpu_allocations.h>
#include <torchpar/common/cpu_block_cache.h>

namespace {

constexpr size_t MiB = size_t{1} << 20;

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

} // namespace

TEST_CASE("block cache: a freed block serves the next of its size, a larger one is split, nothing is mapped anew",
          "[common][block_cache]") {
  torchpar::CpuBlockCache cache(128 << 10, SIZE_MAX, 256 * MiB);
  CHECK_FALSE(cache.serves(64 << 10));
  CHECK_FALSE(torchpar::CpuBlockCache(128 << 10, MiB, MiB).serves(MiB));  // the next pool's
  auto* four = static_cast<char*>(cache.take(4 * MiB - 100));
  REQUIRE(four != nullptr);
  CHECK(reinterpret_cast<uintptr_t>(four) % static_cast<uintptr_t>(sysconf(_SC_PAGESIZE)) == 0);
  CHECK(cache.reserved_bytes() == static_cast<int64_t>(4 * MiB));
  REQUIRE(cache.give_back(four));
  CHECK(cache.free_bytes() == static_cast<int64_t>(4 * MiB));
  CHECK(cache.take(4 * MiB) == four);  // the same block again
  REQUIRE(cache.give_back(four));
  // 1 MiB from the 4 MiB block: its start, the rest still free and serving the next.
  auto* one = static_cast<char*>(cache.take(MiB));
  CHECK(one == four);
  auto* rest = static_cast<char*>(cache.take(3 * MiB));
  CHECK(rest == four + MiB);
  CHECK(cache.reserved_bytes() == static_cast<int64_t>(4 * MiB));
  CHECK(cache.free_bytes() == 0);
  int outside = 0;
  CHECK_FALSE(cache.give_back(&outside));  // not the cache's: left alone
  CHECK(cache.give_back(one));
  CHECK(cache.give_back(rest));
  // Both pieces free: whole again, for a 4 MiB request, as it was.
  CHECK(cache.free_bytes() == static_cast<int64_t>(4 * MiB));
  CHECK(cache.take(4 * MiB) == four);
  CHECK(cache.reserved_bytes() == static_cast<int64_t>(4 * MiB));
  // Blocks of different mappings never join, even where the kernel put them side by side.
  auto* other = static_cast<char*>(cache.take(4 * MiB));
  REQUIRE(cache.give_back(four));
  REQUIRE(cache.give_back(other));
  auto* both = static_cast<char*>(cache.take(8 * MiB));  // their pages moved under one new mapping
  CHECK(both != four);
  CHECK(cache.reserved_bytes() == static_cast<int64_t>(8 * MiB));
  REQUIRE(cache.give_back(both));
}

TEST_CASE("block cache: a block no free one holds takes their pages, moved, not faulted in again",
          "[common][block_cache]") {
  torchpar::CpuBlockCache cache(128 << 10, SIZE_MAX, 256 * MiB);
  auto* first = static_cast<char*>(cache.take(2 * MiB));
  auto* second = static_cast<char*>(cache.take(2 * MiB));
  std::memset(first, 1, 2 * MiB);
  std::memset(second, 2, 2 * MiB);
  REQUIRE(cache.give_back(first));
  REQUIRE(cache.give_back(second));
  // 5 MiB: both free blocks' pages under one mapping, 1 MiB new.
  auto* large = static_cast<char*>(cache.take(5 * MiB));
  REQUIRE(large != nullptr);
  CHECK(cache.reserved_bytes() == static_cast<int64_t>(5 * MiB));
  CHECK(cache.free_bytes() == 0);
  // The first 4 MiB are the written pages themselves (their bytes came along), the last is fresh and zero.
  CHECK(((large[0] == 1 && large[2 * MiB] == 2) || (large[0] == 2 && large[2 * MiB] == 1)));
  CHECK(large[4 * MiB] == 0);
  const long before = minor_faults();
  std::memset(large, 3, 4 * MiB);
  // 1,024 pages, none faulted in; under AddressSanitizer its shadow of them is (an eighth: 128 pages).
  CHECK(minor_faults() - before < 256);
  REQUIRE(cache.give_back(large));
}

TEST_CASE("block cache: free blocks beyond the limit, least recently freed first, go back to the system",
          "[common][block_cache]") {
  torchpar::CpuBlockCache cache(128 << 10, SIZE_MAX, 3 * MiB);
  auto* older = cache.take(2 * MiB);
  auto* newer = cache.take(2 * MiB);
  REQUIRE(cache.give_back(older));
  REQUIRE(cache.give_back(newer));  // 4 MiB free > 3: the older is unmapped
  CHECK(cache.free_bytes() == static_cast<int64_t>(2 * MiB));
  CHECK(cache.reserved_bytes() == static_cast<int64_t>(2 * MiB));
  CHECK(cache.take(2 * MiB) == newer);
  REQUIRE(cache.give_back(newer));
  cache.release_free_blocks();
  CHECK(cache.reserved_bytes() == 0);
  // The limit stays: two blocks of 1 MiB are kept again.
  auto* a = cache.take(MiB);
  auto* b = cache.take(MiB);
  REQUIRE(cache.give_back(a));
  REQUIRE(cache.give_back(b));
  CHECK(cache.free_bytes() == static_cast<int64_t>(2 * MiB));
}

TEST_CASE("keep_freed_memory: LibTorch's large tensors come from the cache, reserved follows their peak",
          "[common][block_cache]") {
  torchpar::keep_freed_memory();
  REQUIRE(torchpar::keeping_freed_memory());
  REQUIRE(torchpar::counting_cpu_allocations());
  torchpar::release_freed_memory();
  torchpar::reset_cpu_allocation_peak();
  const auto start = torchpar::cpu_allocations();
  for (int step = 0; step < 5; ++step) {  // sizes alternating as a training step's do
    auto a = at::empty({1 << 20}).fill_(1);  // 4 MiB, written: its pages faulted in
    auto b = at::empty({1 << 19}).fill_(1);  // 2 MiB
    a.reset();
    auto c = at::empty({5 << 18}).fill_(1);  // 5 MiB, b alive: a's pages and 1 MiB new, on the first step
    auto small = at::empty({100});           // the heap's
  }
  const auto after = torchpar::cpu_allocations();
  CHECK(after.current == start.current);
  CHECK(after.peak - start.current == (7 << 20) + 400);
  // At most the peak of the blocks alive at once (2 + 5 MiB), not each size's own peak (4 + 2 + 5).
  CHECK(after.peak_reserved - start.reserved <= static_cast<int64_t>(7 * MiB));
  const long before = minor_faults();
  { auto again = at::empty({5 << 18}); again.fill_(1); }
  CHECK(minor_faults() - before < 64);  // kept: not faulted in
  torchpar::release_freed_memory();
  CHECK(torchpar::cpu_allocations().reserved == 0);
}
