// Training checkpoints that survive a crash at any moment, for every strategy: each rank writes its
// own state (a DDP replica, a pipeline rank's stages, its RNG and data position) into a folder per
// step, and rank 0 writes the step's MANIFEST once every rank's file is on disk. A step without its
// manifest does not count, so a job killed mid-save resumes from the step before.
#pragma once
#include <torchpar/common/c10d_fwd.h>
#include <torchpar/common/peer_processes.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace torch::serialize {
class InputArchive;
class OutputArchive;
} // namespace torch::serialize

namespace torchpar {

struct CheckpointerOptions {
  // Complete checkpoints kept; older ones are removed after each save.
  TORCH_ARG(int, keep) = 2;
  // Where the few bookkeeping collectives run (NCCL groups take no CPU tensors).
  TORCH_ARG(c10::Device, control_device) = c10::Device(c10::kCPU);
};

// `directory` must be the same folder for every rank (a shared file system across hosts):
//   directory/step-000000000120/rank-1-of-4.pt ... MANIFEST
class Checkpointer {
 public:
  // Collective (it learns which process is which rank, to name a rank that dies during a save).
  Checkpointer(std::string directory, c10::intrusive_ptr<c10d::ProcessGroup> group,
               CheckpointerOptions options = {});

  // Collective: every rank passes the same step and writes its own state into the archive. Throws on
  // every rank when any rank could not write (naming it); the previous checkpoints then stay.
  void save(int64_t step, const std::function<void(torch::serialize::OutputArchive&)>& write);
  // The newest complete checkpoint's step, the same on every rank (rank 0 looks). Collective.
  std::optional<int64_t> latest_step();
  // Reads this rank's state of checkpoint `step`.
  void load(int64_t step, const std::function<void(torch::serialize::InputArchive&)>& read) const;

  // The same with the state as bytes (Python's torch.save output).
  void save_bytes(int64_t step, const std::string& bytes);
  std::string load_bytes(int64_t step) const;

  const std::string& directory() const { return directory_; }

 private:
  // The collective part of a save: `bytes` is this rank's state, or nothing when producing it failed
  // with `local_error`.
  void commit(int64_t step, const std::optional<std::string>& bytes, const std::string& local_error);
  void remove_superseded(int64_t newest) const;
  // One of the save's collectives, its failure naming the rank that died or stopped.
  at::Tensor agree(const at::Tensor& tensor, bool broadcast_from_0);

  std::string directory_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  CheckpointerOptions options_;
  PeerProcesses peers_;
};

// The random number generators' states (CPU, and each CUDA device present), so that dropout and
// random augmentations continue after a restart exactly as they would have.
void save_rng_state(torch::serialize::OutputArchive& archive);
void load_rng_state(torch::serialize::InputArchive& archive);

} // namespace torchpar
