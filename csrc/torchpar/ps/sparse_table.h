#pragma once
// A server's rows of a sparse table (those whose id hashes to it). A row exists once touched: its
// values come from the table's initializer, seeded by the row id; storage grows with touched rows
// only, whatever the table's logical row count.
#include <torchpar/ps/optimizer.h>
#include <torchpar/ps/table.h>

#include <c10/util/flat_hash_map.h>

namespace torchpar::ps {

class SparseTable : public Table {
 public:
  SparseTable(std::string name, c10::ScalarType dtype, int64_t num_rows, int64_t dim, RowInitializer initializer,
              OptimizerConfig optimizer, int num_workers);

  bool is_sparse() const override { return true; }
  int64_t bytes() const override;
  int64_t num_rows() const { return num_rows_; }
  int64_t dim() const { return dim_; }
  const RowInitializer& initializer() const { return initializer_; }
  int64_t touched_rows() const { return static_cast<int64_t>(ids_.size()); }

  // [count, dim]; rows not seen before are created.
  at::Tensor read_rows(const int64_t* ids, int64_t count);
  void apply_mean(const std::vector<at::Tensor>& ids, const std::vector<at::Tensor>& grads) override;
  c10::impl::GenericDict snapshot() const override;
  void restore(const c10::impl::GenericDict& state) override;

 private:
  at::Tensor slots_of(const int64_t* ids, int64_t count);
  void grow(int64_t rows);

  int64_t num_rows_;
  int64_t dim_;
  RowInitializer initializer_;
  ska::flat_hash_map<int64_t, int64_t> slot_of_;
  std::vector<int64_t> ids_; // by slot
  at::Tensor values_;        // [capacity, dim]
  RowOptimizerState state_;  // [capacity, dim] each, step [capacity]
};

// The first value of row `id`: what read_rows returns for a row never pushed to.
void initialize_row(const RowInitializer& initializer, int64_t id, double* out, int64_t dim);
// The first values of rows `ids` (any integer dtype and shape), as float64 [ids.numel(), dim].
at::Tensor initial_rows(const RowInitializer& initializer, const at::Tensor& ids, int64_t dim);

} // namespace torchpar::ps
