// A LibTorch module's parameters and buffers with their dotted names, as wrappers take them.
#pragma once
#include <torchpar/common/replica_check.h>

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace torchpar {

NamedTensors named_parameters_of(const torch::nn::Module& module);
NamedTensors named_buffers_of(const torch::nn::Module& module);

} // namespace torchpar
