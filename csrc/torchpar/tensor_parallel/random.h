// Randomness under tensor parallelism, Megatron's rule. Activations replicated over the tensor group
// (after a RowParallelLinear's all-reduce, outside sequence parallelism) must get the same dropout mask on
// every rank of the group, else the replicas drift apart; activations split over the group (attention
// heads, a ColumnParallelLinear's output, sequence-parallel regions) must get different masks, else every
// shard drops the same pattern. So: the default CPU generator is seeded alike on the group's ranks, and a
// second, per-rank stream (seed + 2718 + tensor rank) serves the split regions inside fork().
//
//   TensorParallelRandom random(seed, grid.tensor_group());
//   x = dropout(x);                          // replicated: the default stream, equal on every rank
//   { auto split = random.fork(); h = dropout(h); }   // split: this rank's own stream
#pragma once
#include <torchpar/common/generator_state.h>
#include <torchpar/tensor_parallel/mappings.h>

#include <memory>

namespace torchpar::tensor_parallel {

class TensorParallelRandom {
 public:
  static constexpr uint64_t kSplitStreamOffset = 2718; // Megatron's, so seeds mean the same there

  // Seeds the default CPU generator with `seed` and this rank's split stream with
  // seed + kSplitStreamOffset + its rank in `tensor_group`. Every rank of the job may pass the same seed.
  TensorParallelRandom(uint64_t seed, const Group& tensor_group);

  // While the returned guard lives, the default CPU generator draws from this rank's split stream;
  // afterwards it continues its own, and the split stream continues where it stopped next time.
  std::unique_ptr<GeneratorStateGuard> fork();

 private:
  at::Tensor split_state_;
};

} // namespace torchpar::tensor_parallel
