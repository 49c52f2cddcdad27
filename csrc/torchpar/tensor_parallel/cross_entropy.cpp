#include <torchpar/tensor_parallel/cross_entropy.h>

#include <torchpar/tensor_parallel/vocabulary.h>

#include <ATen/ops/stack.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <vector>

namespace torchpar::tensor_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The loss per position (0 where the target is ignored); the reduction is ordinary autograd around it.
struct VocabParallelCrossEntropy : public torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            const Group& group, int64_t ignore_index, double label_smoothing) {
    const int size = group_size(group);
    const int64_t local_vocabulary = logits.size(-1);
    const int64_t vocabulary = local_vocabulary * size;
    const int64_t begin = local_vocabulary * group_rank(group);
    TORCH_CHECK(target.scalar_type() == at::kLong, "vocab_parallel_cross_entropy: targets must be int64, got ",
                target.scalar_type());
    TORCH_CHECK(target.sizes() == logits.sizes().slice(0, logits.dim() - 1),
                "vocab_parallel_cross_entropy: logits of shape ", logits.sizes(), " (this rank's ", local_vocabulary,
                " of ", vocabulary, " ids) need targets of shape ", logits.sizes().slice(0, logits.dim() - 1),
                ", got ", target.sizes());
    const auto ignored = target.eq(ignore_index);
    // An ignored target may lie outside the vocabulary (-100); it stands in as id 0 from here on.
    const auto kept_target = target.masked_fill(ignored, 0);
    check_in_vocabulary(kept_target, vocabulary, "vocab_parallel_cross_entropy", "target");
    const auto local_max = std::get<0>(logits.detach().max(-1));
    const auto shifted = logits.detach() - collectives::all_reduce_max(local_max, group).unsqueeze(-1);
    const auto outside =
        (kept_target < begin).logical_or(kept_target >= begin + local_vocabulary).logical_or(ignored);
    const auto local_target = (kept_target - begin).masked_fill(outside, 0);
    auto exponentials = shifted.exp();
    // Every sum over the vocabulary in one all-reduce: [Σ exp, the target's logit, Σ logits].
    std::vector<at::Tensor> local_sums{exponentials.sum(-1),
                                       shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0)};
    if (label_smoothing > 0) local_sums.push_back(shifted.sum(-1));
    const auto sums = collectives::all_reduce_sum(at::stack(local_sums), group);
    const auto log_sum = sums[0].log();
    auto loss = log_sum - sums[1];
    if (label_smoothing > 0) {
      // torch's smoothing term: eps times the mean over the vocabulary of -log p_j = log Σ exp - mean logit.
      loss = loss.mul(1 - label_smoothing).add_((log_sum - sums[2] / vocabulary).mul_(label_smoothing));
    }
    loss.masked_fill_(ignored, 0);
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["vocabulary"] = vocabulary;
    ctx->save_for_backward({exponentials.div_(sums[0].unsqueeze(-1)), local_target, outside, ignored});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& softmax = saved[0];
    const auto& local_target = saved[1];
    const auto& outside = saved[2];
    const auto& ignored = saved[3];
    const double label_smoothing = ctx->saved_data["label_smoothing"].toDouble();
    const int64_t vocabulary = ctx->saved_data["vocabulary"].toInt();
    // d loss / d logit_j = p_j - (1 - eps) one_hot(target)_j - eps / V; the one only on the rank holding
    // the target.
    auto grad = softmax.clone();
    if (label_smoothing > 0) grad.sub_(label_smoothing / static_cast<double>(vocabulary));
    grad.scatter_add_(-1, local_target.unsqueeze(-1),
                      outside.logical_not().to(grad.scalar_type()).mul_(label_smoothing - 1).unsqueeze(-1));
    // masked, not multiplied: a mean over no position sends an infinite gradient that must stay 0 here.
    grad.mul_(grads[0].unsqueeze(-1)).masked_fill_(ignored.unsqueeze(-1), 0);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

} // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target, const Group& group,
                                        const VocabParallelCrossEntropyOptions& options) {
  TORCH_CHECK(logits.dim() >= 1, "vocab_parallel_cross_entropy: logits need a vocabulary dimension");
  const double label_smoothing = options.label_smoothing();
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0,
              "vocab_parallel_cross_entropy: label_smoothing must be between 0.0 and 1.0, got ", label_smoothing);
  const auto losses =
      VocabParallelCrossEntropy::apply(logits, target, group, options.ignore_index(), label_smoothing);
  if (std::holds_alternative<torch::enumtype::kNone>(options.reduction())) return losses;
  if (std::holds_alternative<torch::enumtype::kSum>(options.reduction())) return losses.sum();
  const auto counted = target.ne(options.ignore_index()).sum().to(losses.scalar_type());
  return losses.sum().div(counted);
}

} // namespace torchpar::tensor_parallel
