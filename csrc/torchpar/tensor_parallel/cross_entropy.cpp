#include <torchpar/tensor_parallel/cross_entropy.h>

#include <torchpar/tensor_parallel/vocabulary.h>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace torchpar::tensor_parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct VocabParallelCrossEntropy : public torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            const Group& group) {
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
    check_in_vocabulary(target, vocabulary, "vocab_parallel_cross_entropy", "target");
    const auto local_max = std::get<0>(logits.detach().max(-1));
    const auto shifted = logits.detach() - collectives::all_reduce_max(local_max, group).unsqueeze(-1);
    const auto outside = (target < begin).logical_or(target >= begin + local_vocabulary);
    const auto local_target = (target - begin).masked_fill(outside, 0);
    const auto target_logit = collectives::all_reduce_sum(
        shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0), group);
    const auto exponentials = shifted.exp();
    const auto sum_exponentials = collectives::all_reduce_sum(exponentials.sum(-1), group);
    ctx->save_for_backward({exponentials.div_(sum_exponentials.unsqueeze(-1)), local_target, outside});
    return sum_exponentials.log() - target_logit;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& softmax = saved[0];
    const auto& local_target = saved[1];
    const auto& outside = saved[2];
    // d loss / d logit = softmax - one_hot(target), the one only on the rank holding the target.
    auto grad = softmax.clone();
    grad.scatter_add_(-1, local_target.unsqueeze(-1), outside.logical_not().to(grad.scalar_type()).neg().unsqueeze(-1));
    return {grad.mul_(grads[0].unsqueeze(-1)), at::Tensor(), at::Tensor()};
  }
};

} // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target, const Group& group) {
  TORCH_CHECK(logits.dim() >= 1, "vocab_parallel_cross_entropy: logits need a vocabulary dimension");
  return VocabParallelCrossEntropy::apply(logits, target, group);
}

} // namespace torchpar::tensor_parallel
