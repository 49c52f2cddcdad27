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
// stages 1-2) a Unit is its inner module. A Unit's forward takes and returns one tensor (so a Unit is itself any
// module, AnyModule and Sequential included); call() takes whatever its inner module's forward takes and returns
// ReturnType, at::Tensor or a std::tuple or std::vector of tensors, each output's gradient gathering it again:
//
//   auto [hidden, attention] = block0->call<std::tuple<at::Tensor, at::Tensor>>(x, mask);
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace torchpar::sharded {

class ShardedCoordinator;

class UnitImpl : public torch::nn::Module {
 public:
  explicit UnitImpl(torch::nn::AnyModule inner);
  at::Tensor forward(const at::Tensor& input) { return call(input); }

  template <typename ReturnType = at::Tensor, typename... Args>
  ReturnType call(Args&&... args) {
    if (coordinator_ == nullptr) return inner_.forward<ReturnType>(std::forward<Args>(args)...);
    before_forward();
    ReturnType output = inner_.forward<ReturnType>(std::forward<Args>(args)...);
    after_forward();
    if constexpr (std::is_same_v<ReturnType, at::Tensor>) {
      gather_before_backward_of(output);
    } else if constexpr (std::is_same_v<ReturnType, std::vector<at::Tensor>>) {
      for (auto& tensor : output) gather_before_backward_of(tensor);
    } else {
      std::apply([this](auto&... tensors) { (gather_before_backward_of(tensors), ...); }, output);
    }
    return output;
  }
  torch::nn::AnyModule& inner() { return inner_; }

  // Set by the ShardedDataParallel that makes this a unit (`unit` its number, 1.. in its coordinator), cleared when
  // that wrapper goes.
  void attach(ShardedCoordinator* coordinator, int unit);
  void detach() { attach(nullptr, 0); }

 private:
  void before_forward();
  void after_forward();
  void gather_before_backward_of(at::Tensor& output);  // before the unit's backward, when its gradient arrives

  torch::nn::AnyModule inner_;
  ShardedCoordinator* coordinator_ = nullptr;
  int unit_ = 0;
};
TORCH_MODULE(Unit);

} // namespace torchpar::sharded
