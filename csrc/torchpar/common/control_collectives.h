// Small blocking collectives for bookkeeping (DDP's used-parameter maps, bucket orders, join status
// and replica check; checkpoints' agreement): on a given device (NCCL groups take no CPU tensors),
// results back on the CPU for reading.
#pragma once
#include <torchpar/common/c10d_fwd.h>

#include <ATen/core/Tensor.h>

#include <vector>

namespace torchpar {

at::Tensor all_reduce_sum(c10d::ProcessGroup& group, const at::Tensor& tensor, at::Device device);
// Every rank's copy of `tensor` (all the same shape), in rank order.
std::vector<at::Tensor> all_gather(c10d::ProcessGroup& group, const at::Tensor& tensor, at::Device device);
// Rank `root`'s `tensor` on every rank.
at::Tensor broadcast(c10d::ProcessGroup& group, const at::Tensor& tensor, at::Device device, int root = 0);

} // namespace torchpar
