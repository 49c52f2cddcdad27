// A callback for each parameter at the moment backward has written its .grad: what DDP's reducer and
// the parameter server's RemoteParameters start their communication from, while backward goes on.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace torch::autograd {
struct Node;
} // namespace torch::autograd

namespace torchpar {

class GradientReadyHooks {
 public:
  // `on_ready(i)` runs on the autograd thread right after parameter i's gradient accumulated (a leaf
  // that requires grad, or this throws). It may throw: backward then fails with its message.
  GradientReadyHooks(std::vector<at::Tensor> parameters, std::function<void(size_t)> on_ready);
  ~GradientReadyHooks(); // removes the hooks
  GradientReadyHooks(const GradientReadyHooks&) = delete;
  GradientReadyHooks& operator=(const GradientReadyHooks&) = delete;

  // The autograd node that accumulates parameter i's gradient (to find it in a graph).
  torch::autograd::Node* accumulator(size_t index) const { return accumulators_[index]; }
  // Moves the hooks of parameters whose accumulator autograd replaced (e.g. after `.data` was set).
  void follow_replaced_accumulators();

 private:
  void attach(size_t index);

  std::vector<at::Tensor> parameters_;
  std::function<void(size_t)> on_ready_;
  std::vector<torch::autograd::Node*> accumulators_;
  std::vector<std::shared_ptr<void>> accumulator_owners_; // a parameter holds its accumulator weakly
  std::vector<uintptr_t> hook_keys_;
};

} // namespace torchpar
