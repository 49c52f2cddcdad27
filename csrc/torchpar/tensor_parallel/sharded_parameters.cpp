#include <torchpar/tensor_parallel/sharded_parameters.h>

#include <torchpar/tensor_parallel/layers.h>

#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cmath>
#include <map>

namespace torchpar::tensor_parallel {
namespace {

// The split dim of each parameter of a tensor-parallel layer, by its name within the layer.
std::map<std::string, int64_t> split_dims_of(const torch::nn::Module& layer) {
  if (dynamic_cast<const ColumnParallelLinearImpl*>(&layer)) return {{"weight", 0}, {"bias", 0}};
  if (dynamic_cast<const RowParallelLinearImpl*>(&layer)) return {{"weight", 1}};
  if (dynamic_cast<const VocabParallelEmbeddingImpl*>(&layer)) return {{"weight", 0}};
  return {};
}

} // namespace

std::vector<ParameterLayout> parameter_layouts(const torch::nn::Module& module) {
  std::map<std::string, int64_t> split_dim_of;
  for (const auto& item : module.named_modules()) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& [name, dim] : split_dims_of(*item.value())) {
      split_dim_of[prefix + name] = dim;
    }
  }
  std::vector<ParameterLayout> layouts;
  for (const auto& item : module.named_parameters()) {
    const auto found = split_dim_of.find(item.key());
    layouts.push_back({item.key(), item.value(), found == split_dim_of.end() ? -1 : found->second});
  }
  return layouts;
}

double clip_grad_norm(const std::vector<ParameterLayout>& parameters, double max_norm, const Group& tensor_group,
                      const Group& pipeline_group) {
  // [sum of squares of the shards, of the replicated parameters], in float64 whatever the gradients' dtype.
  auto squares = at::zeros({2}, at::kDouble);
  for (const auto& layout : parameters) {
    const auto& grad = layout.parameter.grad();
    if (!grad.defined()) continue;
    squares[layout.split_dim >= 0 ? 0 : 1] += grad.detach().to(at::kDouble).pow(2).sum();
  }
  // Shards add up over the tensor group; replicated parameters are the same on every rank of it.
  auto shards = collectives::all_reduce_sum(squares.narrow(0, 0, 1), tensor_group);
  auto total = shards + squares.narrow(0, 1, 1);
  if (pipeline_group) {
    total = collectives::all_reduce_sum(total, pipeline_group);
  }
  const double norm = std::sqrt(total.item<double>());
  // torch's clip_grad_norm_: scale by max_norm / (norm + 1e-6), only when that is below one.
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0) {
    c10::NoGradGuard no_grad;
    for (const auto& layout : parameters) {
      auto grad = layout.parameter.grad();
      if (grad.defined()) grad.mul_(scale);
    }
  }
  return norm;
}

torch::OrderedDict<std::string, at::Tensor> full_state_dict(const torch::nn::Module& module, const Group& tensor_group) {
  torch::OrderedDict<std::string, at::Tensor> state;
  for (const auto& layout : parameter_layouts(module)) {
    state.insert(layout.name, layout.split_dim >= 0
                                  ? collectives::all_gather(layout.parameter, layout.split_dim, tensor_group)
                                  : layout.parameter.detach().clone());
  }
  for (const auto& item : module.named_buffers()) {
    state.insert(item.key(), item.value().detach().clone());
  }
  return state;
}

void load_full_state_dict(torch::nn::Module& module, const torch::OrderedDict<std::string, at::Tensor>& state,
                          const Group& tensor_group) {
  c10::NoGradGuard no_grad;
  auto load = [&](const std::string& name, at::Tensor target, int64_t split_dim) {
    const auto* full = state.find(name);
    TORCH_CHECK(full, "load_full_state_dict: the state_dict has no '", name, "'");
    const auto value = split_dim >= 0 ? collectives::local_slice(*full, split_dim, tensor_group, name.c_str()) : *full;
    TORCH_CHECK(value.sizes() == target.sizes(), "load_full_state_dict: '", name, "' has shape ", full->sizes(),
                ", which gives this rank ", value.sizes(), " where the module holds ", target.sizes());
    target.copy_(value);
  };
  for (const auto& layout : parameter_layouts(module)) {
    load(layout.name, layout.parameter, layout.split_dim);
  }
  for (const auto& item : module.named_buffers()) {
    load(item.key(), item.value(), -1);
  }
}

} // namespace torchpar::tensor_parallel
