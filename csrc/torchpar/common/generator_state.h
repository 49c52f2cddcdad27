// The default CPU generator switched to another random stream for a scope: the pipeline replays a
// micro-batch's forward with the randomness it first had (activation recomputation), tensor
// parallelism draws dropout masks from a per-rank stream.
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

namespace torchpar {

class GeneratorStateGuard {
 public:
  // The default CPU generator takes `state` until the guard goes; then its own state comes back. With
  // `advanced`, the stream's state at that moment is written there, so the stream continues next time.
  explicit GeneratorStateGuard(const at::Tensor& state, at::Tensor* advanced = nullptr);
  ~GeneratorStateGuard();
  GeneratorStateGuard(const GeneratorStateGuard&) = delete;
  GeneratorStateGuard& operator=(const GeneratorStateGuard&) = delete;

 private:
  at::Generator generator_;
  at::Tensor saved_;
  at::Tensor* advanced_;
};

} // namespace torchpar
