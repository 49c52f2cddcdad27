#include <torchpar/common/module_tensors.h>

#include <torch/nn/module.h>

namespace torchpar {

NamedTensors named_parameters_of(const torch::nn::Module& module) {
  NamedTensors result;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    result.emplace_back(item.key(), item.value());
  }
  return result;
}

NamedTensors named_buffers_of(const torch::nn::Module& module) {
  NamedTensors result;
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    result.emplace_back(item.key(), item.value());
  }
  return result;
}

} // namespace torchpar
