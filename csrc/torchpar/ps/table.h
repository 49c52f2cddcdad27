#pragma once
// What a server holds of one table: its part of the values, the optimizer that updates them, and
// the clocks consistency is decided on (how many pushes each worker made, how many BSP rounds were
// applied, the gradients of rounds still waiting for workers).
#include <torchpar/ps/config.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torchpar::ps {

class Table {
 public:
  Table(std::string name, c10::ScalarType dtype, OptimizerConfig optimizer, int num_workers);
  virtual ~Table() = default;

  const std::string& name() const { return name_; }
  c10::ScalarType dtype() const { return dtype_; }
  OptimizerConfig& optimizer() { return optimizer_; }
  const OptimizerConfig& optimizer() const { return optimizer_; }
  virtual bool is_sparse() const = 0;
  virtual int64_t bytes() const = 0;

  // One optimizer step with the mean of `grads` (ids: row ids per gradient for sparse tables,
  // undefined for dense). Contributions come in worker order, so a step is reproducible.
  virtual void apply_mean(const std::vector<at::Tensor>& ids, const std::vector<at::Tensor>& grads) = 0;

  // Per worker: pushes received. BSP: rounds applied and the contributions of rounds not yet full.
  std::vector<int64_t> pushes;
  int64_t applied = 0;
  struct Round {
    std::vector<std::optional<std::pair<at::Tensor, at::Tensor>>> contributions; // per worker: ids, grads
    int count = 0;
    std::chrono::steady_clock::time_point opened = std::chrono::steady_clock::now();
  };
  std::map<int64_t, Round> rounds;

  // Values, optimizer state and clocks; `restore` takes what `snapshot` gave (a checkpoint).
  virtual c10::impl::GenericDict snapshot() const;
  virtual void restore(const c10::impl::GenericDict& state);

 private:
  std::string name_;
  c10::ScalarType dtype_;
  OptimizerConfig optimizer_;
};

using Tables = std::vector<std::unique_ptr<Table>>; // by table id

c10::IValue optimizer_to_ivalue(const OptimizerConfig& config);
OptimizerConfig optimizer_from_ivalue(const c10::IValue& value);

} // namespace torchpar::ps
