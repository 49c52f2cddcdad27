#pragma once
#include <chrono>
#include <string>
#include <vector>

#include <c10/core/DeviceType.h>
#include <torchpar/common/c10d_fwd.h>

namespace torchpar::comm {

struct BackendChoice {
  c10::DeviceType device;
  std::string name;
};

// torch.distributed's backend strings: "gloo" (CPU and CUDA tensors), "nccl" (CUDA tensors), "shm"
// (torchpar's shared-memory backend, CPU tensors) or a per-device list "cpu:shm,cuda:nccl". The
// first entry is the process group's default backend.
std::vector<BackendChoice> parse_backend_spec(const std::string& spec);

// Throws a c10::Error saying why a chosen backend cannot run on this rank (NCCL not compiled in,
// no GPU for LOCAL_RANK) before any rank starts connecting.
void check_backends_usable(const std::vector<BackendChoice>& choices, int rank, int local_rank);

// One backend instance, by name, on a store already private to the process group.
c10::intrusive_ptr<c10d::Backend> make_backend(
    const std::string& name,
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int world_size,
    int local_rank,
    std::chrono::milliseconds timeout);

} // namespace torchpar::comm
