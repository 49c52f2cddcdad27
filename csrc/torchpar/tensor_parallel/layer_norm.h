// LayerNorm for the sequence-parallel regions between tensor-parallel layers (Megatron-LM's sequence
// parallelism). There each rank normalises its own slice of the sequence with the same replicated weight
// and bias, so each rank's gradient of them covers only its positions: the module sums it over the
// tensor group in backward (its weight and bias pass through copy_to_tensor_parallel), and the ranks'
// copies stay equal after every optimizer step without a separate gradient all-reduce.
//
//   SequenceParallelLayerNorm(group, torch::nn::LayerNormOptions({1024}))
//
// Dropout in the same regions draws from TensorParallelRandom::fork() (different positions, different masks).
#pragma once
#include <torchpar/tensor_parallel/mappings.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/options/normalization.h>
#include <torch/nn/pimpl.h>

namespace torchpar::tensor_parallel {

class SequenceParallelLayerNormImpl : public torch::nn::Cloneable<SequenceParallelLayerNormImpl> {
 public:
  SequenceParallelLayerNormImpl(Group group, torch::nn::LayerNormOptions options);
  void reset() override;
  at::Tensor forward(const at::Tensor& input);

  torch::nn::LayerNormOptions options;
  Group group;
  at::Tensor weight; // replicated over the group; undefined without elementwise_affine
  at::Tensor bias;
};
TORCH_MODULE(SequenceParallelLayerNorm);

// The module's forward as a function: what the Python module (torchpar.tensor_parallel) runs too.
at::Tensor sequence_parallel_layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                        const at::Tensor& weight, const at::Tensor& bias, double eps,
                                        const Group& group);

} // namespace torchpar::tensor_parallel
