// A stage-3 unit inside any LibTorch module. LibTorch modules have no forward hooks, so a ShardedDataParallel can
// gather a unit just around its forward only where it runs the forward itself (a torch::nn::Sequential's children);
// elsewhere the model registers the submodule wrapped in a Unit:
//
//   block0 = register_module("block0", torchpar::sharded::Unit(Block(256)));
//   ...
//   x = block0(x);   // in the model's forward
//
// and a ShardedDataParallel at stage 3 over the model makes each Unit a unit (unless .units() names others): the
// Unit gathers its parameters just before its inner module's forward, frees them after it, and gathers them again
// when its output's gradient arrives, before its backward, as Python's hooks do. Outside such a wrapper (or at
// stages 1-2) a Unit is its inner module. A Unit takes and returns one tensor.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

namespace torchpar::sharded {

class ShardedCoordinator;

class UnitImpl : public torch::nn::Module {
 public:
  explicit UnitImpl(torch::nn::AnyModule inner);
  at::Tensor forward(const at::Tensor& input);
  torch::nn::AnyModule& inner() { return inner_; }

  // Set by the ShardedDataParallel that makes this a unit (`unit` its number, 1.. in its coordinator), cleared when
  // that wrapper goes.
  void attach(ShardedCoordinator* coordinator, int unit);
  void detach() { attach(nullptr, 0); }

 private:
  torch::nn::AnyModule inner_;
  ShardedCoordinator* coordinator_ = nullptr;
  int unit_ = 0;
};
TORCH_MODULE(Unit);

} // namespace torchpar::sharded
