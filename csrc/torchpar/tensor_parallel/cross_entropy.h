// Cross-entropy over logits split along the vocabulary (a ColumnParallelLinear's output, not gathered)
// that never gathers the full logits: per position, an all-reduce of the largest logit, then one
// all-reduce of every sum over the vocabulary — of the exponentials, of the target's logit (which only its
// owning rank holds) and, with label smoothing, of the logits. Two [positions]-sized all-reduces instead
// of a [positions, vocabulary] all-gather. The result and the gradient are torch::nn::functional::
// cross_entropy's on the full logits, with its ignore_index, label_smoothing and reductions.
//
//   auto loss = vocab_parallel_cross_entropy(logits, target, group,
//       VocabParallelCrossEntropyOptions().ignore_index(0).label_smoothing(0.1).reduction(torch::kSum));
#pragma once
#include <torchpar/tensor_parallel/mappings.h>

#include <torch/arg.h>
#include <torch/enum.h>

#include <variant>

namespace torchpar::tensor_parallel {

struct VocabParallelCrossEntropyOptions {
  typedef std::variant<torch::enumtype::kNone, torch::enumtype::kMean, torch::enumtype::kSum> reduction_t;
  // Positions whose target is this id have loss 0 and gradient 0, and the mean does not count them.
  TORCH_ARG(int64_t, ignore_index) = -100;
  // eps in [0, 1]: the target distribution is (1 - eps) on the target plus eps spread evenly over the
  // whole vocabulary (every rank's ids), as torch's label_smoothing.
  TORCH_ARG(double, label_smoothing) = 0.0;
  // kMean divides by the number of positions not ignored (NaN when every position is ignored, as torch).
  TORCH_ARG(reduction_t, reduction) = torch::kMean;
};

// logits: [*, vocabulary / size] (this rank's slice, ids [rank * V / size, (rank + 1) * V / size));
// target: int64 [*], each in [0, V) or ignore_index. Returns the loss per position [*] with kNone, else
// a scalar; the same on every rank of the group.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target, const Group& group,
                                        const VocabParallelCrossEntropyOptions& options = {});

} // namespace torchpar::tensor_parallel
