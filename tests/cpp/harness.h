// Runs a test body on N real ranks: N forked processes joined into one c10d process group.
//
//   run_on_ranks(3, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
//     ... REQUIRE(...) ...
//   });
//
// Every rank's Catch2 assertions count: a failed CHECK or REQUIRE, an exception, a crash or a
// rank still running at the deadline fails the calling test with that rank's message and the tail
// of its output. The other ranks are killed at once, so a hung rank never hangs the suite.
#pragma once
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <torchpar/common/c10d_fwd.h>

namespace torchpar::testing {

using RankBody = std::function<void(int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg)>;

struct RankOptions {
  std::string backend = "gloo";
  std::chrono::milliseconds deadline{std::chrono::seconds(120)}; // whole run, all ranks
  std::chrono::milliseconds collective_timeout{std::chrono::seconds(60)};
};

struct RankOutcome {
  int rank = 0;
  bool passed = false;
  std::string message; // why it failed, then the tail of what it printed
};

// Runs `body` on `world` ranks and reports each rank's outcome; never throws for a rank's failure.
std::vector<RankOutcome> launch_ranks(int world, const RankBody& body, const RankOptions& options = {});

// launch_ranks, then fails the current Catch2 test with every failed rank's message.
void run_on_ranks(int world, const RankBody& body, const RankOptions& options = {});

// Ends this rank at once, as a crash would (no destructors: its connections just close), yet counted
// as passed: for tests of how the other ranks see a peer die.
[[noreturn]] void leave_abruptly();

// Assertions that failed in this process so far (counted by a Catch2 listener in main.cpp).
int failed_assertions();

} // namespace torchpar::testing
