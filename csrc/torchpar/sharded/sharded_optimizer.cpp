#include <torchpar/sharded/sharded_optimizer.h>

namespace torchpar::sharded {

ShardedOptimizer::ShardedOptimizer(ShardedCoordinator& coordinator, std::unique_ptr<torch::optim::Optimizer> optimizer)
    : coordinator_(&coordinator), optimizer_(std::move(optimizer)) {
  size_t stepped = 0;
  for (const auto& group : optimizer_->param_groups()) {
    for (const auto& parameter : group.params()) {
      bool in_shard = false;
      for (const auto& shard : coordinator.shard()) in_shard = in_shard || parameter.is_same(shard);
      TORCH_CHECK(in_shard, "ShardedOptimizer: the optimizer steps a tensor that is not this rank's shard; build it "
                  "over ShardedCoordinator::shard() (ShardedDataParallel::optimizer does)");
      ++stepped;
    }
  }
  TORCH_CHECK(stepped == coordinator.shard().size(), "ShardedOptimizer: the optimizer steps ", stepped, " of the ",
              coordinator.shard().size(), " shard tensors; build it over all of ShardedCoordinator::shard()");
}

void ShardedOptimizer::step() {
  optimizer_->step();
  coordinator_->gather_parameters();
}

void ShardedOptimizer::zero_grad() {
  optimizer_->zero_grad();
  coordinator_->zero_parameter_gradients();
}

} // namespace torchpar::sharded
