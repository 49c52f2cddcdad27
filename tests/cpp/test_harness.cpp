// The harness must turn every way a rank can go wrong into a reported failure, in time.
#include <csignal>
#include <stdexcept>
#include <thread>

#include "catch_with_torch.h"
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "harness.h"

using torchpar::testing::launch_ranks;
using torchpar::testing::RankOptions;
using Catch::Matchers::Contains;

namespace {
using Clock = std::chrono::steady_clock;
}

TEST_CASE("harness: ranks that pass are reported as passed", "[harness]") {
  const auto outcomes = launch_ranks(3, [](int, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    pg->barrier()->wait();
  });
  REQUIRE(outcomes.size() == 3);
  for (const auto& outcome : outcomes) {
    CHECK(outcome.passed);
  }
}

TEST_CASE("harness: a crashing rank fails the run with its signal and output", "[harness]") {
  const auto outcomes = launch_ranks(2, [](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    if (rank == 1) {
      std::puts("about to crash");
      std::fflush(stdout);
      std::signal(SIGSEGV, SIG_DFL); // a plain crash, also where a sanitizer handles SIGSEGV
      std::raise(SIGSEGV);
    }
    pg->barrier()->wait(); // rank 0 waits for the dead rank 1 and must be killed, not hang
  });
  CHECK_FALSE(outcomes[1].passed);
  CHECK_THAT(outcomes[1].message, Contains("signal 11") && Contains("about to crash"));
  // Rank 0 either notices the dead peer itself (gloo: connection reset) or is killed by the harness.
  CHECK_FALSE(outcomes[0].passed);
}

TEST_CASE("harness: a hung rank is killed at the deadline", "[harness]") {
  RankOptions options;
  options.deadline = std::chrono::seconds(5);
  const auto start = Clock::now();
  const auto outcomes = launch_ranks(2, [](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    pg->barrier()->wait();  // rank 1 leaves only once rank 0's group is connected
    if (rank == 0) {
      std::this_thread::sleep_for(std::chrono::hours(1));
    }
  }, options);
  CHECK(Clock::now() - start < std::chrono::seconds(30));
  CHECK_FALSE(outcomes[0].passed);
  CHECK_THAT(outcomes[0].message, Contains("still running at the deadline of 5 s"));
}

TEST_CASE("harness: a failed CHECK or an exception on one rank fails the run", "[harness]") {
  const auto outcomes = launch_ranks(3, [](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    // Every rank's group is connected before any fails: a rank leaving while rank 0 still connects its
    // group would fail rank 0 on its own (connection closed by peer), not by the harness.
    pg->barrier()->wait();
    if (rank == 1) {
      CHECK(rank == 0); // does not throw: the harness must still see it
    }
    if (rank == 2) {
      throw std::runtime_error("rank two gave up");
    }
  });
  // Rank 0 hosts the store and waits for the others to finish; the harness kills it once rank 1 or 2 failed.
  CHECK_FALSE(outcomes[0].passed);
  CHECK_THAT(outcomes[0].message, Contains("was killed after rank"));
  CHECK_FALSE(outcomes[1].passed);
  CHECK_THAT(outcomes[1].message, Contains("1 assertion(s) failed"));
  CHECK_FALSE(outcomes[2].passed);
  CHECK_THAT(outcomes[2].message, Contains("rank two gave up"));
}
