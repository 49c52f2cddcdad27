// Cross-entropy over logits split along the vocabulary (a ColumnParallelLinear's output, not gathered)
// that never gathers the full logits: per position, an all-reduce of the largest logit, of the sum of
// exponentials and of the target's logit (which only its owning rank holds). Three [positions]-sized
// all-reduces instead of a [positions, vocabulary] all-gather.
#pragma once
#include <torchpar/tensor_parallel/mappings.h>

namespace torchpar::tensor_parallel {

// logits: [*, vocabulary / size] (this rank's slice, ids [rank * V / size, (rank + 1) * V / size));
// target: int64 [*] in [0, V). Returns the loss per position, [*] (reduce it, e.g. with .mean()).
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target, const Group& group);

} // namespace torchpar::tensor_parallel
