// Any LibTorch optimizer over one rank's shard (ShardedCoordinator::shard()): step() steps the shard, then
// all-gathers every rank's updated shard into the parameters; zero_grad() clears the shard's gradients and
// the parameters' own.
#pragma once
#include <torchpar/sharded/sharded_coordinator.h>

#include <torch/optim/optimizer.h>

#include <memory>

namespace torchpar::sharded {

class ShardedOptimizer {
 public:
  // `optimizer` must have been built over coordinator.shard().
  ShardedOptimizer(ShardedCoordinator& coordinator, std::unique_ptr<torch::optim::Optimizer> optimizer);

  void step();
  void zero_grad();
  // torch::nn::utils::clip_grad_norm_ over the whole model's averaged gradients (collective); the norm.
  double clip_grad_norm(double max_norm, double norm_type = 2.0) {
    return coordinator_->clip_grad_norm(max_norm, norm_type);
  }
  torch::optim::Optimizer& inner() { return *optimizer_; }
  ShardedCoordinator& coordinator() { return *coordinator_; }

 private:
  ShardedCoordinator* coordinator_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

} // namespace torchpar::sharded
