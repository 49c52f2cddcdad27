#include <torchpar/ddp/distributed_data_parallel.h>

namespace torchpar::ddp::detail {

NamedTensors named_parameters(const torch::nn::Module& module) {
  NamedTensors result;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    result.emplace_back(item.key(), item.value());
  }
  return result;
}

NamedTensors named_buffers(const torch::nn::Module& module) {
  NamedTensors result;
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    result.emplace_back(item.key(), item.value());
  }
  return result;
}

} // namespace torchpar::ddp::detail
