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
  auto* coordinator = coordinator_;
  const int unit = unit_;
  coordinator->before_unit_forward(unit);
  at::Tensor output = inner_.forward<at::Tensor>(input);
  coordinator->after_unit_forward(unit);
  if (output.requires_grad()) {
    output.register_hook([coordinator, unit](const at::Tensor&) { coordinator->before_unit_backward(unit); });
  }
  return output;
}

} // namespace torchpar::sharded
