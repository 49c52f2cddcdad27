#pragma once
#include <chrono>

#include <torchpar/common/c10d_fwd.h>

namespace torchpar::comm {

// Throws a c10::Error saying why when rank `rank` (host-local index `local_rank`) has no GPU.
void check_nccl_usable(int rank, int local_rank);

// c10d's NCCL backend for CUDA tensors; rank `local_rank` of this host uses cuda:local_rank.
// Throws a c10::Error saying why when no GPU is visible for this rank. Defined only in builds
// with TORCHPAR_HAS_NCCL (torch with CUDA, NCCL headers found).
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int world_size,
    int local_rank,
    std::chrono::milliseconds timeout);

} // namespace torchpar::comm
