// Whether a group reduces the tensors of an allreduce_coalesced where they lie: DDP can then hand it
// the gradients themselves instead of copying them into a bucket and back.
#pragma once
#include <torchpar/common/c10d_fwd.h>

namespace torchpar::comm {

// True for torchpar's shm backend (on one host) as the group's CPU backend: its allreduce_coalesced of
// CPU tensors packs nothing and supports AVG. Gloo packs the tensors into one buffer and has no AVG,
// so DDP's own bucket serves it better.
bool reduces_coalesced_in_place(c10d::ProcessGroup& group);

} // namespace torchpar::comm
