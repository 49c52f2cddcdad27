#include <torchpar/pipeline/linear_layer.h>

#include <ATen/autocast_mode.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

namespace torchpar::pipeline {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether this backward may add `parameter`'s gradient into .grad itself: only where autograd would
// accumulate it there (a backward, not a grad() that captures it; no graph of the gradients being
// built) and nothing would see the accumulation (hooks on the tensor or its grad accumulator).
bool may_accumulate_in_place(const at::Tensor& parameter) {
  namespace impl = torch::autograd::impl;
  if (at::GradMode::is_enabled() || !parameter.is_leaf() || !impl::hooks(parameter).empty() ||
      impl::post_acc_grad_hooks(parameter)) {
    return false;
  }
  const auto accumulator = impl::try_get_grad_accumulator(parameter);
  if (!accumulator || !accumulator->pre_hooks().empty() || !accumulator->tensor_pre_hooks().empty() ||
      !accumulator->post_hooks().empty()) {
    return false;
  }
  const auto* execution = torch::autograd::get_current_graph_task_exec_info();
  if (execution == nullptr || execution->empty()) {
    return execution != nullptr;  // empty: a backward() running every node
  }
  const auto entry = execution->find(accumulator.get());
  return entry != execution->end() && entry->second.needed_ && !entry->second.captures_;
}

void accumulate(at::Tensor& gradient, at::Tensor addend) {
  if (gradient.defined()) {
    gradient.add_(addend);
  } else {
    gradient = std::move(addend);
  }
}

struct LinearAccumulatingWeightGradient : torch::autograd::Function<LinearAccumulatingWeightGradient> {
  // `bias` an optional: autograd takes an undefined tensor for no bias as an input it cannot describe.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    const at::Tensor bias_or_none = bias.value_or(at::Tensor());
    ctx->save_for_backward(bias_or_none.defined() ? variable_list{input, weight, bias_or_none}
                                                  : variable_list{input, weight});
    return at::linear(input, weight, bias_or_none);
  }

  static variable_list backward(AutogradContext* ctx, variable_list output_gradients) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    at::Tensor weight = saved[1];
    at::Tensor bias = saved.size() == 3 ? saved[2] : at::Tensor();
    const at::Tensor& gradient = output_gradients[0];
    variable_list result(3);
    if (ctx->needs_input_grad(0)) {
      result[0] = at::matmul(gradient, weight);
    }
    const bool weight_wanted = ctx->needs_input_grad(1);
    const bool bias_wanted = bias.defined() && ctx->needs_input_grad(2);
    if (!weight_wanted && !bias_wanted) {
      return result;
    }
    const auto rows = gradient.reshape({-1, gradient.size(-1)});
    if (weight_wanted) {
      const auto inputs = input.reshape({-1, input.size(-1)});
      if (!may_accumulate_in_place(weight)) {
        result[1] = at::mm(rows.t(), inputs);
      } else if (weight.grad().defined()) {
        weight.mutable_grad().addmm_(rows.t(), inputs);
      } else {
        weight.mutable_grad() = at::mm(rows.t(), inputs);
      }
    }
    if (bias_wanted) {
      auto bias_gradient = rows.sum(0);
      if (!may_accumulate_in_place(bias)) {
        result[2] = std::move(bias_gradient);
      } else {
        accumulate(bias.mutable_grad(), std::move(bias_gradient));
      }
    }
    return result;
  }
};

} // namespace

at::Tensor linear_accumulating_weight_gradient(const at::Tensor& input, const at::Tensor& weight,
                                               const at::Tensor& bias) {
  return LinearAccumulatingWeightGradient::apply(input, weight,
                                                 bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
}

Layer linear_layer(const std::string& name, at::Tensor weight, at::Tensor bias) {
  Layer layer;
  layer.name = name;
  layer.parameters = bias.defined() ? Tensors{weight, bias} : Tensors{weight};
  layer.parameter_names = bias.defined() ? std::vector<std::string>{"weight", "bias"} : std::vector<std::string>{"weight"};
  layer.accumulates_weight_gradient = true;
  layer.forward = [name, weight = std::move(weight), bias = std::move(bias)](const Tensors& inputs) -> Tensors {
    TORCH_CHECK(inputs.size() == 1, "pipeline layer ", name, " is a linear layer taking one tensor; it was given ",
                inputs.size());
    // Under autocast the product runs in a lower precision than the weight; autograd's own linear
    // records the casts its backward needs.
    if (at::autocast::is_autocast_enabled(inputs[0].device().type())) {
      return {at::linear(inputs[0], weight, bias)};
    }
    return {linear_accumulating_weight_gradient(inputs[0], weight, bias)};
  };
  return layer;
}

} // namespace torchpar::pipeline
