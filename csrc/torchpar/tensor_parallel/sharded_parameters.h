// What a module's tensor-parallel layers hold: each parameter either a shard (split along a dim over
// the tensor group) or replicated (the same on every rank of the group: a RowParallelLinear's bias,
// LayerNorm, every parameter of an ordinary layer). The gradient norm and the full state_dict need to know.
#pragma once
#include <torchpar/tensor_parallel/mappings.h>

#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <string>
#include <vector>

namespace torchpar::tensor_parallel {

struct ParameterLayout {
  std::string name;
  at::Tensor parameter;
  int64_t split_dim = -1; // -1: replicated
};

// Every parameter of `module` (named as module.named_parameters() names them) with its layout.
std::vector<ParameterLayout> parameter_layouts(const torch::nn::Module& module);

// Scales every gradient by max_norm / total norm when the total 2-norm exceeds max_norm, and returns
// the total norm, as torch::nn::utils::clip_grad_norm_ would on the single-process model: a shard's
// squares are summed over `tensor_group`, a replicated parameter counts once, and with `pipeline_group`
// the stages' sums add up too. Call it after the data-parallel average, on every rank.
double clip_grad_norm(const std::vector<ParameterLayout>& parameters, double max_norm, const Group& tensor_group,
                      const Group& pipeline_group = {});

// The single-process state_dict: shards all-gathered along their split dim (collective over the tensor
// group; every rank gets the whole), replicated parameters and buffers as they are.
torch::OrderedDict<std::string, at::Tensor> full_state_dict(const torch::nn::Module& module, const Group& tensor_group);
// Loads a single-process state_dict: each rank copies its slice of every shard, replicated values whole.
// A missing or misshapen entry is an error naming it.
void load_full_state_dict(torch::nn::Module& module, const torch::OrderedDict<std::string, at::Tensor>& state,
                          const Group& tensor_group);

} // namespace torchpar::tensor_parallel
