// Deliberate faults in a rank, one per sanitizer, that scripts/sanitize.sh runs before the suite to
// show that its sanitizers see into the ranks (forked processes that leave through _exit) and that
// a report fails the test. Hidden ([.]): no normal run, and no ctest entry, includes them.
#include <climits>
#include <thread>

#include "catch_with_torch.h"
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "harness.h"

using torchpar::testing::run_on_ranks;

namespace {

int* volatile leaked = nullptr;

[[gnu::noinline]] void leak() {
  leaked = new int[64];
  leaked = nullptr;
}

} // namespace

TEST_CASE("sanitizer self-check: memory leaked in a rank", "[.][sanitizer-selfcheck][leak]") {
  run_on_ranks(1, [](int, int, c10::intrusive_ptr<c10d::ProcessGroup>) { leak(); });
}

TEST_CASE("sanitizer self-check: signed overflow in a rank", "[.][sanitizer-selfcheck][undefined]") {
  run_on_ranks(1, [](int, int, c10::intrusive_ptr<c10d::ProcessGroup>) {
    volatile int largest = INT_MAX;
    volatile int overflowed = largest + 1;
    (void)overflowed;
  });
}

TEST_CASE("sanitizer self-check: a data race between two threads of a rank", "[.][sanitizer-selfcheck][race]") {
  run_on_ranks(1, [](int, int, c10::intrusive_ptr<c10d::ProcessGroup>) {
    int counter = 0;
    std::thread other([&] { ++counter; });
    ++counter;
    other.join();
  });
}
