#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include <torchpar/comm/shm/layout.h>

namespace torchpar::comm::shm {

// Marks one more phase done by this rank and wakes ranks sleeping on it. Data written before it is
// visible to every rank that then sees the new count.
void advance(RankControl& mine);

// Waits until every rank's progress has reached `target`: spins for `spin_for` (a peer on another
// core is usually nanoseconds away), then yields, then sleeps on a futex so that more ranks than
// cores still make progress. Throws c10::DistBackendError when the deadline passes or a rank's
// process has died, naming the op (`what()` describes it) and the ranks that are behind.
void wait_for_all(
    RankControl* controls,
    int world,
    uint32_t target,
    std::chrono::steady_clock::time_point deadline,
    std::chrono::microseconds spin_for,
    const std::function<std::string()>& what);

// How long wait_for_all should spin for `local_ranks` ranks on this host: long where each can have
// a core of its own (a peer late by a scheduler tick is still cheaper to spin for than to sleep
// for), briefly where ranks share cores (spinning takes the core a peer needs).
std::chrono::microseconds spin_budget(int local_ranks);

} // namespace torchpar::comm::shm
