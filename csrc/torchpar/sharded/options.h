// Options of torchpar's sharded data parallelism, in LibTorch's builder style:
//   ShardedOptions().process_group(group).stage(2).bucket_cap_mb(25)
#pragma once
#include <torch/arg.h>
#include <torchpar/common/c10d_fwd.h>

#include <c10/core/ScalarType.h>
#include <c10/util/intrusive_ptr.h>

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace torchpar::sharded {

// The reduce-scatters a backward keeps in flight before it waits for the oldest, each holding its bucket's
// gradients in one flat tensor and its reduced piece: more would hold most of the gradients again at stage 2
// (the planner's memory model counts them).
inline constexpr size_t kReductionsInFlight = 2;

struct ShardedOptions {
  // The data-parallel group the state is sharded over (required).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, process_group);
  // ZeRO's stage: 1 shards the optimizer state (each rank keeps its full local gradients until zero_grad),
  // 2 also the gradients (a parameter's gradient is released once its bucket is reduce-scattered), 3 also
  // the parameters (each unit's gathered only around its forward and its backward).
  TORCH_ARG(int, stage) = 2;
  // Stage 3's units, by module name ("layers.0"): a parameter belongs to the unit of the longest name its
  // own name starts with, else (or when two of its names, tied, fall in different units) to the root unit,
  // which stays gathered from the forward to the end of backward. Given in forward order.
  TORCH_ARG(std::vector<std::string>, units);
  // Stage 3: free a unit's parameters after its forward and gather them again for its backward (ZeRO-3), or
  // keep them until its gradients are reduced (less traffic, ZeRO-2's memory for them in between).
  TORCH_ARG(bool, reshard_after_forward) = true;
  // Stage 3: the next unit's all-gather started as soon as the current unit's is done (the unit after it in
  // forward, the one before it in backward), so it moves while this one computes; one more unit gathered at a
  // time. Unset: on for CUDA parameters, off for CPU ones, where it bought 3-5% for a unit more at peak
  // (docs/sharded.md). Ranks must agree.
  TORCH_ARG(std::optional<bool>, prefetch) = std::nullopt;
  // Gradient bytes per reduce-scatter (and per all-gather of the updated parameters); stages 1 and 2.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  // The first bucket's (the last layers' gradients), as DDP's: small, so that a reduce-scatter starts early in
  // backward; stages 1 and 2.
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  // Rank 0's buffers (BatchNorm's running statistics) copied to every rank before each synchronised forward,
  // as DDP's broadcast_buffers.
  TORCH_ARG(bool, broadcast_buffers) = true;
  // Mixed precision, as FSDP2's MixedPrecisionPolicy: the dtype floating-point parameters are cast to for
  // forward and backward (and all-gathered in), while the shard keeps the master copy in their own dtype;
  // unset, no cast.
  TORCH_ARG(std::optional<c10::ScalarType>, param_dtype) = std::nullopt;
  // The dtype gradients are reduced in; unset, param_dtype, else the parameter's own.
  TORCH_ARG(std::optional<c10::ScalarType>, reduce_dtype) = std::nullopt;
};

} // namespace torchpar::sharded
