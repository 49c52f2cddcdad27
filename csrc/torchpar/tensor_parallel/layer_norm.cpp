#include <torchpar/tensor_parallel/layer_norm.h>

#include <ATen/ops/layer_norm.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

namespace torchpar::tensor_parallel {

at::Tensor sequence_parallel_layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                        const at::Tensor& weight, const at::Tensor& bias, double eps,
                                        const Group& group) {
  const auto summed = [&](const at::Tensor& parameter) {
    return parameter.defined() ? copy_to_tensor_parallel(parameter, group) : parameter;
  };
  return at::layer_norm(input, normalized_shape, summed(weight), summed(bias), eps);
}

SequenceParallelLayerNormImpl::SequenceParallelLayerNormImpl(Group group_, torch::nn::LayerNormOptions options_)
    : options(std::move(options_)), group(std::move(group_)) {
  reset();
}

void SequenceParallelLayerNormImpl::reset() {
  if (!options.elementwise_affine()) return;
  const auto shape = options.normalized_shape();
  weight = register_parameter("weight", at::ones(shape));
  bias = register_parameter("bias", at::zeros(shape));
}

at::Tensor SequenceParallelLayerNormImpl::forward(const at::Tensor& input) {
  return sequence_parallel_layer_norm(input, options.normalized_shape(), weight, bias, options.eps(), group);
}

} // namespace torchpar::tensor_parallel
