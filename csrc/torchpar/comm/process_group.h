#pragma once
#include <vector>
#include <chrono>
#include <optional>
#include <string>

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <torchpar/common/c10d_fwd.h>
#include <torchpar/comm/launch_error.h>

namespace torchpar::comm {

// Options of init_process_group, in LibTorch's builder style:
//   init_process_group(InitOptions().backend("gloo").timeout(std::chrono::seconds(60)))
struct InitOptions {
  // "gloo", "nccl" or "cpu:gloo,cuda:nccl"; empty: TORCHPAR_BACKEND, else "gloo".
  TORCH_ARG(std::string, backend);
  // For the rendezvous and every collective; unset: TORCHPAR_TIMEOUT (seconds), else 30 minutes
  // (torch.distributed's default).
  TORCH_ARG(std::optional<std::chrono::milliseconds>, timeout);
  // For programs not launched by torchrun; unset: RANK / WORLD_SIZE from the environment.
  TORCH_ARG(std::optional<int>, rank);
  TORCH_ARG(std::optional<int>, world_size);
  // A store the ranks already share; unset: the torchrun rendezvous store (MASTER_ADDR/PORT).
  TORCH_ARG(c10::intrusive_ptr<c10d::Store>, store);
};

// The timeout init_process_group uses for `options` (see InitOptions::timeout).
std::chrono::milliseconds resolve_timeout(const InitOptions& options);

// A process group over every rank of the job, created from what torchrun put in the environment
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
// TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_USE_AGENT_STORE). Returns once every rank has joined.
// TORCHPAR_BIND_CORES=1 first pins the process to its local rank's share of the cores (bind_cores).
// A wrong launch throws LaunchError with a one-line message; collectives then go through the
// returned group (c10d::ProcessGroup's API: allreduce, broadcast, send/recv ...).
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const InitOptions& options = {});

// A process group over `ranks` (ranks of `parent`, which become 0..n-1 in the new group), as
// torch.distributed.new_group: every rank of `parent` calls it with the same list, in the same order
// as its other new_group calls; ranks outside the list get a null pointer. `options` gives the
// backend and timeout (as for init_process_group); its rank, world size and store are not used.
c10::intrusive_ptr<c10d::ProcessGroup> new_group(const c10::intrusive_ptr<c10d::ProcessGroup>& parent,
                                                 const std::vector<int>& ranks, const InitOptions& options = {});

// An "shm" group over `group`'s ranks, in the same order, where `group` is Gloo with every rank on this host
// (common/host_id.h), for the bulk data of data-parallel training (Gloo's reduce-scatter clones its input and
// all-reduces it; shm's moves each byte once through shared memory); null otherwise, or when
// TORCHPAR_DDP_SAME_HOST=0. Collective over `group`; each call makes a new group, named after `group` and how many
// were made beside it (not by new_group's count, which a group only some ranks make would shift on those ranks).
c10::intrusive_ptr<c10d::ProcessGroup> shm_group_beside(const c10::intrusive_ptr<c10d::ProcessGroup>& group);
// Whether shm_group_beside(group) makes one (without making it). Collective over `group`.
bool shm_group_fits_beside(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

} // namespace torchpar::comm

namespace torchpar {
using comm::InitOptions;
using comm::init_process_group;
using comm::new_group;
using comm::shm_group_beside;
using comm::LaunchError;
} // namespace torchpar
