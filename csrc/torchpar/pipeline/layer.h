// A layer as the pipeline sees it: a function from tensors to tensors and the parameters it trains.
// LibTorch modules, Python nn.Modules and plain functions all become Layers, so one runtime serves
// C++ and Python.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace torch::nn {
class AnyModule;
class SequentialImpl;
} // namespace torch::nn

namespace torchpar::pipeline {

using Tensors = std::vector<at::Tensor>;

struct Layer {
  std::string name;
  std::function<Tensors(const Tensors&)> forward;
  Tensors parameters;
  // The names of `parameters`, in order ("weight", "attn.c_attn.bias"), as the module names them: how
  // PipelineOptions::shared_parameters and messages address a parameter. Empty: by position only.
  std::vector<std::string> parameter_names;
};

// A layer building itself; the pipeline calls only the factories of its own stages, so no rank ever
// holds the whole model.
using LayerFactory = std::function<Layer()>;

// A LibTorch module taking and returning one tensor (what torch::nn::Sequential chains).
Layer layer_from_module(const std::string& name, torch::nn::AnyModule module);
std::vector<Layer> layers_from_sequential(const torch::nn::SequentialImpl& sequential);

} // namespace torchpar::pipeline
