#pragma once
// Server-side optimizers, applied where the parameters live. Dense shards follow torch.optim's
// single-tensor SGD / Adagrad / Adam step for step; sparse rows keep their state per row (a row's
// step count starts at its first update), so each row moves exactly as torch.optim would move that
// row alone given the gradients it received.
#include <torchpar/ps/config.h>

#include <ATen/core/Tensor.h>

namespace torchpar::ps {

struct DenseOptimizerState {
  at::Tensor momentum_buffer; // SGD with momentum; undefined before the first step, as torch's
  at::Tensor sum;             // Adagrad
  at::Tensor exp_avg;         // Adam
  at::Tensor exp_avg_sq;      // Adam
  int64_t step = 0;
};

// Refuses hyper-parameters outside torch.optim's ranges, and those a step would convert to a value
// the table's dtype cannot hold (which would make every later update of the table throw).
void check_optimizer(const OptimizerConfig& config, c10::ScalarType dtype, const std::string& table);

DenseOptimizerState initial_dense_state(const OptimizerConfig& config, const at::Tensor& values);
void apply_dense(const OptimizerConfig& config, at::Tensor& values, const at::Tensor& grad, DenseOptimizerState& state);

// The state of some rows, gathered [rows, dim] (steps: [rows]); updated in place with the values.
struct RowOptimizerState {
  at::Tensor sum;        // Adagrad
  at::Tensor exp_avg;    // Adam
  at::Tensor exp_avg_sq; // Adam
  at::Tensor step;       // Adam, int64 per row
};

// Refuses options the sparse path does not implement (momentum, weight decay) with the reason.
void check_row_optimizer(const OptimizerConfig& config, const std::string& table);
void apply_rows(const OptimizerConfig& config, at::Tensor& rows, const at::Tensor& grads, RowOptimizerState& state);

} // namespace torchpar::ps
