// Sharded data parallelism (ZeRO stages 1 and 2) for LibTorch modules. A training loop changes three lines:
//
//   namespace sh = torchpar::sharded;
//   sh::ShardedDataParallel sharded(model, sh::ShardedOptions().process_group(group).stage(2));
//   auto optimizer = sharded.optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3));  // on the shard
//   ...
//   optimizer.zero_grad();
//   torch::nll_loss(sharded(batch.data), batch.target).backward();  // was model->forward(...)
//   optimizer.step();                  // this rank's shard stepped, then every rank's shard all-gathered
#pragma once
#include <torchpar/common/module_tensors.h>
#include <torchpar/common/no_sync_guard.h>
#include <torchpar/sharded/sharded_coordinator.h>
#include <torchpar/sharded/sharded_optimizer.h>

#include <torch/nn/module.h>

#include <memory>
#include <utility>

namespace torchpar::sharded {

using NoSyncGuard = torchpar::NoSyncGuard<ShardedCoordinator>;

// `ModuleHolder` is a LibTorch module holder (torch::nn::Sequential, or a TORCH_MODULE(Net) type).
template <typename ModuleHolder>
class ShardedDataParallel {
 public:
  ShardedDataParallel(ModuleHolder module, ShardedOptions options)
      : module_(std::move(module)),
        coordinator_(std::make_unique<ShardedCoordinator>(named_parameters_of(*module_),
                                                          named_buffers_of(*module_), std::move(options))) {}

  // Stage 3: a LibTorch module has no forward hooks to gather each unit around its own forward, so the whole
  // model is gathered for the forward and released unit by unit as backward reduces it (Python's wrapper
  // gathers unit by unit).
  template <typename... Args>
  auto forward(Args&&... args) {
    coordinator_->pre_forward(coordinator_->will_sync());
    if (coordinator_->stage() == 3) coordinator_->gather_all();
    return module_->forward(std::forward<Args>(args)...);
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // A LibTorch optimizer of type `Optimizer` over this rank's shard, stepping it and gathering the result.
  template <typename Optimizer, typename Options>
  ShardedOptimizer optimizer(Options options) {
    return ShardedOptimizer(*coordinator_, std::make_unique<Optimizer>(coordinator_->shard(), std::move(options)));
  }

  NoSyncGuard no_sync() { return NoSyncGuard(*coordinator_); }
  ModuleHolder& module() { return module_; }
  ShardedCoordinator& coordinator() { return *coordinator_; }

 private:
  ModuleHolder module_;
  std::unique_ptr<ShardedCoordinator> coordinator_;
};

} // namespace torchpar::sharded
