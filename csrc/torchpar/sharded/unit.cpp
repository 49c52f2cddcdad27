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

at::Tensor UnitImpl::forward(const at::Tensor& input) {
  if (coordinator_ == nullptr) return inner_.forward<at::Tensor>(input);
  coordinator_->before_unit_forward(unit_);
  at::Tensor output = inner_.forward<at::Tensor>(input);
  coordinator_->after_unit_forward(unit_);
  coordinator_->gather_before_backward_of(unit_, output);
  return output;
}

} // namespace torchpar::sharded
