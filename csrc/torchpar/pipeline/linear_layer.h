// A linear layer whose backward adds its weight gradient straight into .grad.
//
// A pipeline stage runs one backward per micro-batch, and from the second one on plain autograd
// computes each weight gradient into a new tensor and then adds it to .grad (AccumulateGrad): for
// the small micro-batches pipelines run, allocating, filling and adding a weight-sized tensor costs
// as much as the product itself. Here one addmm_ (BLAS with beta = 1) does both, as Megatron-LM's
// gradient-accumulation fusion does on GPUs. Where something observes the accumulation (a hook on
// the weight or on its grad accumulator: DDP's reducer, a user's post-accumulate hook) the gradient
// goes through autograd as usual.
#pragma once
#include <torchpar/pipeline/layer.h>

namespace torchpar::pipeline {

// y = x W^T + b for x of any rank (the last dimension the features); `bias` may be undefined.
at::Tensor linear_accumulating_weight_gradient(const at::Tensor& input, const at::Tensor& weight,
                                               const at::Tensor& bias);

// The layer the pipeline builds for a plain linear module (LibTorch's torch::nn::Linear, Python's nn.Linear).
Layer linear_layer(const std::string& name, at::Tensor weight, at::Tensor bias);

} // namespace torchpar::pipeline
