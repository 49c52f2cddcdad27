#pragma once
#include <chrono>

#include <torchpar/common/c10d_fwd.h>

namespace torchpar::comm {

// c10d's Gloo backend (CPU tensors) on the default network interface.
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int world_size,
    std::chrono::milliseconds timeout);

} // namespace torchpar::comm
