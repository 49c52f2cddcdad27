#include <torchpar/sharded/unit.h>

#include <torchpar/sharded/sharded_coordinator.h>

namespace torchpar::sharded {

UnitImpl::UnitImpl(torch::nn::AnyModule inner) : inner_(std::move(inner)) {
  TORCH_CHECK(!inner_.is_empty(), "torchpar::sharded::Unit: no module to wrap");
  register_module("module", inner_.ptr());
}

void UnitImpl::attach(ShardedCoordinator* coordinator, int unit) {
  coordinator_ = coordinator;
  unit_ = unit;
}

void UnitImpl::before_forward() {
  coordinator_->before_unit_forward(unit_);
}

void UnitImpl::after_forward() {
  coordinator_->after_unit_forward(unit_);
}

void UnitImpl::gather_before_backward_of(at::Tensor& output) {
  coordinator_->gather_before_backward_of(unit_, output);
}

} // namespace torchpar::sharded
