// Options of torchpar's DistributedDataParallel, in LibTorch's builder style:
//   DistributedDataParallelOptions().bucket_cap_mb(25).find_unused_parameters(true)
#pragma once
#include <torch/arg.h>
#include <torchpar/common/c10d_fwd.h>

#include <c10/util/intrusive_ptr.h>

#include <vector>

namespace torchpar::ddp {

struct DistributedDataParallelOptions {
  // The group gradients are averaged over (required).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, process_group);
  // Where the model's data moves instead (optional): the gradient buckets' all-reduces and the parameters'
  // and buffers' broadcasts. A group over the same ranks in the same order, e.g. an "shm" group when
  // process_group is Gloo on one host (Python's DDP makes one itself). The other collectives (the replicas'
  // check, the used-parameter map, join's votes) stay on process_group; a communication hook uses the group
  // it was made with (Python's built-in hooks given no group, or process_group: this one).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, data_process_group);
  // Gradient bytes per all-reduce (torch's default 25 MiB).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  // The first bucket is small so that communication starts early in backward (torch: 1 MiB).
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  // A cap per bucket instead, in all-reduce order, the last serving every later bucket (torch's
  // bucket_cap_mb_list); empty: first_bucket_cap_mb, then bucket_cap_mb.
  TORCH_ARG(std::vector<double>, bucket_cap_mb_list);
  // Trace the autograd graph after each forward and mark parameters it cannot reach as ready.
  TORCH_ARG(bool, find_unused_parameters) = false;
  // Parameters' .grad become views into the flat buckets: no copy after all-reduce, less memory.
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  // Broadcast rank 0's buffers (e.g. BatchNorm running statistics) before each forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  // The set of used parameters and their gradient order are the same every iteration: learnt in the
  // first iteration, after which no graph traversal is needed.
  TORCH_ARG(bool, static_graph) = false;
  // At construction, check that every rank holds the same parameters and copy rank 0's values (and,
  // with init_sync_buffers, its buffers) to all. Off: the caller guarantees equal replicas.
  TORCH_ARG(bool, init_sync) = true;
  TORCH_ARG(bool, init_sync_buffers) = true;
};

} // namespace torchpar::ddp
