#include <torchpar/pipeline/layer.h>

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <torchpar/pipeline/linear_layer.h>

namespace torchpar::pipeline {

Layer layer_from_module(const std::string& name, torch::nn::AnyModule module) {
  if (const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(module.ptr().get())) {
    return linear_layer(name, linear->weight, linear->bias);
  }
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
