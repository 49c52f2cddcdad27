#pragma once
// A server's contiguous range [shard_begin, shard_end) of a dense table, flattened.
#include <torchpar/ps/optimizer.h>
#include <torchpar/ps/table.h>

#include <functional>

namespace torchpar::ps {

class DenseTable : public Table {
 public:
  // `values` become the table's (not copied); `before_change` runs before anything changes them (a
  // server whose values are lent to readers waits there until they are handed back).
  DenseTable(std::string name, std::vector<int64_t> shape, int64_t shard_begin, int64_t shard_end, at::Tensor values,
             OptimizerConfig optimizer, int num_workers, std::function<void()> before_change = {});

  bool is_sparse() const override { return false; }
  int64_t bytes() const override;
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t shard_begin() const { return shard_begin_; }
  int64_t shard_end() const { return shard_end_; }
  int64_t numel() const { return shard_end_ - shard_begin_; }
  const at::Tensor& values() const { return values_; }

  void apply_mean(const std::vector<at::Tensor>& ids, const std::vector<at::Tensor>& grads) override;
  c10::impl::GenericDict snapshot() const override;
  void restore(const c10::impl::GenericDict& state) override;

 private:
  std::vector<int64_t> shape_;
  int64_t shard_begin_;
  int64_t shard_end_;
  at::Tensor values_;
  DenseOptimizerState state_;
  std::function<void()> before_change_;
};

} // namespace torchpar::ps
