#include <torchpar/pipeline/layer.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <torchpar/pipeline/linear_layer.h>

#include <algorithm>
#include <variant>

namespace torchpar::pipeline {
namespace {

bool elementwise(const torch::nn::Module& module) {
  return dynamic_cast<const torch::nn::ReLUImpl*>(&module) || dynamic_cast<const torch::nn::GELUImpl*>(&module) ||
         dynamic_cast<const torch::nn::TanhImpl*>(&module) || dynamic_cast<const torch::nn::SigmoidImpl*>(&module) ||
         dynamic_cast<const torch::nn::SiLUImpl*>(&module) || dynamic_cast<const torch::nn::DropoutImpl*>(&module) ||
         dynamic_cast<const torch::nn::IdentityImpl*>(&module);
}

const torch::nn::LinearImpl* splittable_linear(const torch::nn::Module& module) {
  if (const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(&module)) return linear;
  const auto* sequential = dynamic_cast<const torch::nn::SequentialImpl*>(&module);
  if (sequential == nullptr || sequential->is_empty()) return nullptr;
  const auto children = sequential->children();
  for (size_t i = 1; i < children.size(); ++i) {
    if (!elementwise(*children[i])) return nullptr;
  }
  return dynamic_cast<const torch::nn::LinearImpl*>(children.front().get());
}

void count_embedding(const at::Tensor& weight, LayerTraits& traits) {
  traits.embedding_bytes += static_cast<int64_t>(weight.nbytes());
  traits.embedding_row_bytes = std::max(traits.embedding_row_bytes, static_cast<int64_t>(weight[0].nbytes()));
}

// A module without a faster layer of its own: its forward, called on one tensor.
Layer module_layer(const std::string& name, torch::nn::AnyModule module) {
  Layer layer;
  layer.name = name;
  for (const auto& named : module.ptr()->named_parameters()) {
    layer.parameter_names.push_back(named.key());
    layer.parameters.push_back(named.value());
  }
  layer.forward = [name, module = std::move(module)](const Tensors& inputs) mutable -> Tensors {
    TORCH_CHECK(inputs.size() == 1, "pipeline layer ", name, " is a LibTorch module taking one tensor; it was given ",
                inputs.size(), " (wrap modules that pass tuples in a torchpar::pipeline::Layer)");
    return {module.forward<at::Tensor>(inputs[0])};
  };
  return layer;
}

} // namespace

LayerTraits traits_of(const torch::nn::Module& module) {
  LayerTraits traits;
  if (const auto* linear = splittable_linear(module)) {
    traits.split_in_features = linear->options.in_features();
    traits.split_out_features = linear->options.out_features();
  }
  traits.elementwise = elementwise(module);
  const auto visit = [&](const torch::nn::Module& each) {
    if (const auto* table = dynamic_cast<const torch::nn::EmbeddingImpl*>(&each)) {
      count_embedding(table->weight, traits);
    } else if (const auto* bag = dynamic_cast<const torch::nn::EmbeddingBagImpl*>(&each)) {
      // A max over rows has no sparse gradient a server could apply row by row.
      if (!std::holds_alternative<torch::enumtype::kMax>(bag->options.mode())) count_embedding(bag->weight, traits);
    }
  };
  visit(module);
  for (const auto& child : module.modules(/*include_self=*/false)) visit(*child);
  return traits;
}

Layer layer_from_module(const std::string& name, torch::nn::AnyModule module) {
  const LayerTraits traits = traits_of(*module.ptr());
  const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(module.ptr().get());
  Layer layer = linear != nullptr ? linear_layer(name, linear->weight, linear->bias)
                                  : module_layer(name, std::move(module));
  layer.traits = traits;
  return layer;
}

std::vector<Layer> layers_from_sequential(const torch::nn::SequentialImpl& sequential) {
  std::vector<Layer> layers;
  const auto names = sequential.named_children().keys();
  size_t index = 0;
  for (const auto& module : sequential) {
    layers.push_back(layer_from_module(names.at(index++), module));
  }
  return layers;
}

} // namespace torchpar::pipeline
