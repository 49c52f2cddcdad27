// How long a process group's ops wait for a peer: what torchpar's own transports beside a group (the
// pipeline's rings, DDP's same-host gradient group) wait at most too, so that a lost peer is reported
// within the time the user gave the group.
#pragma once
#include <torchpar/common/c10d_fwd.h>

#include <chrono>

namespace torchpar::comm {

// The timeout of `group`'s CPU backend; c10d's default (30 min) for a backend that does not say.
std::chrono::milliseconds group_timeout(c10d::ProcessGroup& group);

} // namespace torchpar::comm
