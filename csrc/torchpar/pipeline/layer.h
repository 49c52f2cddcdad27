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
class Module;
class SequentialImpl;
} // namespace torch::nn

namespace torchpar::pipeline {

using Tensors = std::vector<at::Tensor>;

// What a planner can do with a layer beyond running it, told by whoever builds the layer from a module (C++:
// layer_from_module; Python: the planner's profile), since a Layer is a function and its parameters. The pipeline
// never reads it.
struct LayerTraits {
  // A Linear, alone or followed by elementwise activations, whose weight a tensor group can split: its features.
  int64_t split_in_features = 0;
  int64_t split_out_features = 0;
  // Acts on each element alone (an activation, dropout): it runs as well on a split layer's split output.
  bool elementwise = false;
  // Embedding tables in the layer, looked up by the integer inputs it is fed, that a parameter server can hold as
  // sparse rows: their bytes and the largest row's.
  int64_t embedding_bytes = 0;
  int64_t embedding_row_bytes = 0;
};

struct Layer {
  std::string name;
  std::function<Tensors(const Tensors&)> forward;
  Tensors parameters;
  // The names of `parameters`, in order ("weight", "attn.c_attn.bias"), as the module names them: how
  // PipelineOptions::shared_parameters and messages address a parameter. Empty: by position only.
  std::vector<std::string> parameter_names;
  LayerTraits traits;
  // Its backward adds the weight gradient into .grad itself (linear_layer.h), so that from a stage's second
  // micro-batch on no weight-sized gradient is made and then added: what the planner's memory model counts. (Under
  // autocast, which the planner does not model, linear_layer leaves the accumulation to autograd.)
  bool accumulates_weight_gradient = false;
};

// A layer building itself; the pipeline calls only the factories of its own stages, so no rank ever
// holds the whole model.
using LayerFactory = std::function<Layer()>;

// A LibTorch module taking and returning one tensor (what torch::nn::Sequential chains); its traits found from the
// module: a torch::nn::Linear (or a Sequential of one followed by ReLU, GELU, Tanh, Sigmoid, SiLU, Dropout or
// Identity), one of those elementwise modules, and the Embedding and EmbeddingBag (mean or sum) modules within it.
LayerTraits traits_of(const torch::nn::Module& module);
Layer layer_from_module(const std::string& name, torch::nn::AnyModule module);
std::vector<Layer> layers_from_sequential(const torch::nn::SequentialImpl& sequential);

} // namespace torchpar::pipeline
