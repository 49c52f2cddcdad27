// Compiled only when torch has CUDA and NCCL's headers are found (TORCHPAR_HAS_NCCL); otherwise
// backend_factory.cpp reports that NCCL is not available in this build.
#include <torchpar/comm/nccl_backend.h>

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace torchpar::comm {

void check_nccl_usable(int rank, int local_rank) {
  const auto devices = c10::cuda::device_count();
  TORCH_CHECK(
      devices > 0,
      "torchpar: backend 'nccl' needs CUDA devices, but rank ", rank,
      " sees none (no GPU or CUDA_VISIBLE_DEVICES hides them); use backend 'gloo' for CPU tensors");
  TORCH_CHECK(
      local_rank < devices,
      "torchpar: backend 'nccl': LOCAL_RANK=", local_rank, " of rank ", rank, " has no GPU (this host shows ",
      devices, "); start at most one rank per GPU (torchrun --nproc-per-node=", devices, ")");
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int world_size,
    int local_rank,
    std::chrono::milliseconds timeout) {
  check_nccl_usable(rank, local_rank);
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(local_rank));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, options);
}

} // namespace torchpar::comm
