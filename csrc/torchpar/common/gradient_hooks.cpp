#include <torchpar/common/gradient_hooks.h>

#include <c10/util/irange.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace torchpar {
namespace {

// A post-hook of the AccumulateGrad node: it runs once .grad holds the parameter's final gradient.
class GradientReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit GradientReadyHook(std::function<void()> on_ready) : on_ready_(std::move(on_ready)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    on_ready_();
    return outputs;
  }

 private:
  std::function<void()> on_ready_;
};

} // namespace

GradientReadyHooks::GradientReadyHooks(std::vector<at::Tensor> parameters, std::function<void(size_t)> on_ready)
    : parameters_(std::move(parameters)),
      on_ready_(std::move(on_ready)),
      accumulators_(parameters_.size()),
      accumulator_owners_(parameters_.size()),
      hook_keys_(parameters_.size()) {
  for (const auto i : c10::irange(parameters_.size())) {
    attach(i);
  }
}

GradientReadyHooks::~GradientReadyHooks() {
  for (const auto i : c10::irange(accumulators_.size())) {
    if (accumulators_[i]) {
      accumulators_[i]->del_post_hook(hook_keys_[i]);
    }
  }
}

void GradientReadyHooks::attach(size_t index) {
  const auto& parameter = parameters_[index];
  TORCH_CHECK(parameter.requires_grad() && parameter.is_leaf(), "parameter ", index,
              " is not a leaf tensor that requires grad: its gradient cannot be followed");
  auto accumulator = torch::autograd::impl::grad_accumulator(parameter);
  TORCH_CHECK(accumulator, "parameter ", index, " has no gradient accumulator");
  hook_keys_[index] =
      accumulator->add_post_hook(std::make_unique<GradientReadyHook>([this, index] { on_ready_(index); }));
  accumulators_[index] = accumulator.get();
  // torch 2.11 hands out a shared_ptr, 2.15 an intrusive_ptr: either is kept alive by the deleter's capture.
  accumulator_owners_[index] =
      std::shared_ptr<void>(static_cast<void*>(accumulator.get()), [owner = accumulator](void*) {});
}

void GradientReadyHooks::follow_replaced_accumulators() {
  for (const auto i : c10::irange(parameters_.size())) {
    if (torch::autograd::impl::grad_accumulator(parameters_[i]).get() != accumulators_[i]) {
      accumulators_[i]->del_post_hook(hook_keys_[i]);
      attach(i);
    }
  }
}

} // namespace torchpar
