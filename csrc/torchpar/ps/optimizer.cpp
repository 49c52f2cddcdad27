#include <torchpar/ps/optimizer.h>

#include <ATen/TensorOperators.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace torchpar::ps {

void check_optimizer(const OptimizerConfig& config, c10::ScalarType dtype, const std::string& table) {
  const double largest =
      dtype == c10::kFloat ? std::numeric_limits<float>::max() : std::numeric_limits<double>::max();
  // Also false for NaN.
  auto check = [&](const char* name, double value) {
    TORCH_CHECK(value >= 0 && value <= largest, "torchpar.ps: table '", table, "': ", config.describe(), ": ", name,
                " ", value, " is not in [0, ", largest, "] (", c10::toString(dtype), ")");
  };
  check("lr", config.lr);
  check("weight_decay", config.weight_decay);
  switch (config.kind) {
    case OptimizerConfig::Kind::Sgd:
      check("momentum", config.momentum);
      break;
    case OptimizerConfig::Kind::Adagrad:
      check("eps", config.eps);
      check("initial_accumulator", config.initial_accumulator);
      break;
    case OptimizerConfig::Kind::Adam:
      check("eps", config.eps);
      for (const auto& [name, beta] : {std::pair{"beta1", config.beta1}, std::pair{"beta2", config.beta2}}) {
        TORCH_CHECK(beta >= 0 && beta < 1, "torchpar.ps: table '", table, "': ", config.describe(), ": ", name, " ",
                    beta, " is not in [0, 1)");
      }
      check("the first step's size lr / (1 - beta1)", config.lr / (1 - config.beta1));
      break;
  }
}

DenseOptimizerState initial_dense_state(const OptimizerConfig& config, const at::Tensor& values) {
  DenseOptimizerState state;
  if (config.kind == OptimizerConfig::Kind::Adagrad) {
    state.sum = at::full_like(values, config.initial_accumulator);
  } else if (config.kind == OptimizerConfig::Kind::Adam) {
    state.exp_avg = at::zeros_like(values);
    state.exp_avg_sq = at::zeros_like(values);
  }
  return state;
}

void apply_dense(const OptimizerConfig& config, at::Tensor& values, const at::Tensor& gradient,
                 DenseOptimizerState& state) {
  state.step += 1;
  at::Tensor grad = config.weight_decay != 0 ? gradient.add(values, config.weight_decay) : gradient;
  switch (config.kind) {
    case OptimizerConfig::Kind::Sgd:
      if (config.momentum != 0) {
        if (!state.momentum_buffer.defined()) {
          state.momentum_buffer = grad.clone();
        } else {
          state.momentum_buffer.mul_(config.momentum).add_(grad);
        }
        grad = state.momentum_buffer;
      }
      values.add_(grad, -config.lr);
      break;
    case OptimizerConfig::Kind::Adagrad: {
      state.sum.addcmul_(grad, grad, 1);
      auto std = state.sum.sqrt().add_(config.eps);
      values.addcdiv_(grad, std, -config.lr);
      break;
    }
    case OptimizerConfig::Kind::Adam: {
      state.exp_avg.lerp_(grad, 1 - config.beta1);
      state.exp_avg_sq.mul_(config.beta2).addcmul_(grad, grad, 1 - config.beta2);
      const double step = static_cast<double>(state.step);
      const double bias_correction1 = 1 - std::pow(config.beta1, step);
      const double bias_correction2 = 1 - std::pow(config.beta2, step);
      const double step_size = config.lr / bias_correction1;
      auto denom = (state.exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(config.eps);
      values.addcdiv_(state.exp_avg, denom, -step_size);
      break;
    }
  }
}

void check_row_optimizer(const OptimizerConfig& config, const std::string& table) {
  TORCH_CHECK(config.momentum == 0, "torchpar.ps: sparse table '", table,
              "': SGD momentum is not available for sparse rows (use adagrad or adam)");
  TORCH_CHECK(config.weight_decay == 0, "torchpar.ps: sparse table '", table,
              "': weight decay is not available for sparse rows");
}

void apply_rows(const OptimizerConfig& config, at::Tensor& rows, const at::Tensor& grads, RowOptimizerState& state) {
  switch (config.kind) {
    case OptimizerConfig::Kind::Sgd:
      rows.add_(grads, -config.lr);
      break;
    case OptimizerConfig::Kind::Adagrad: {
      state.sum.addcmul_(grads, grads, 1);
      rows.addcdiv_(grads, state.sum.sqrt().add_(config.eps), -config.lr);
      break;
    }
    case OptimizerConfig::Kind::Adam: {
      state.step.add_(1);
      state.exp_avg.lerp_(grads, 1 - config.beta1);
      state.exp_avg_sq.mul_(config.beta2).addcmul_(grads, grads, 1 - config.beta2);
      const auto step = state.step.to(at::kDouble).unsqueeze(1);
      const auto bias_correction1 = 1 - at::pow(config.beta1, step);
      const auto bias_correction2 = 1 - at::pow(config.beta2, step);
      const auto step_size = (config.lr / bias_correction1).to(rows.scalar_type());
      const auto denom = (state.exp_avg_sq.sqrt() / bias_correction2.sqrt().to(rows.scalar_type())).add_(config.eps);
      rows.sub_(step_size * (state.exp_avg / denom));
      break;
    }
  }
}

} // namespace torchpar::ps
