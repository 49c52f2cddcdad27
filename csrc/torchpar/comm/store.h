#pragma once
#include <chrono>

#include <torchpar/common/c10d_fwd.h>

namespace torchpar::comm {

struct LaunchConfig;

// The rendezvous store of a torchrun launch: a TCPStore client of torchrun's agent store when the
// agent hosts one (TORCHELASTIC_USE_AGENT_STORE=True), otherwise a TCPStore hosted by rank 0 at
// MASTER_ADDR:MASTER_PORT. Either way it is prefixed per restart attempt, so keys left by an
// earlier attempt of a restarted job are never read. Unreachable master → LaunchError.
c10::intrusive_ptr<c10d::Store> connect_store(
    const LaunchConfig& config,
    std::chrono::milliseconds timeout);

// Blocks until all `world_size` ranks have called it on the same (group-private) store, so that
// a missing rank is reported as such ("only 2 of 4 ranks joined ... within 30 s") rather than as a
// timeout deep inside a backend's connection setup.
void wait_for_all_ranks(
    c10d::Store& store,
    int rank,
    int world_size,
    std::chrono::milliseconds timeout);

} // namespace torchpar::comm
