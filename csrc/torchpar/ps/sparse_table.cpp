#include <torchpar/ps/sparse_table.h>

#include <torchpar/ps/row_ids.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <random>

#include <torchpar/common/hash.h>

namespace torchpar::ps {
namespace {

// Room for this many rows at the first touch, but for no more than kInitialBytes of values: one row
// of a very wide table must not cost a thousand (4 GiB at the widest rows a registration allows).
constexpr int64_t kInitialCapacity = 1024;
constexpr int64_t kInitialBytes = int64_t{1} << 20;

at::Tensor grown(const at::Tensor& tensor, int64_t capacity) {
  if (!tensor.defined()) {
    return tensor;
  }
  auto sizes = tensor.sizes().vec();
  sizes[0] = capacity;
  auto bigger = at::zeros(sizes, tensor.options());
  bigger.narrow(0, 0, tensor.size(0)).copy_(tensor);
  return bigger;
}

} // namespace

at::Tensor initial_rows(const RowInitializer& initializer, const at::Tensor& ids, int64_t dim) {
  const auto flat = ids.to(at::kLong).contiguous().view(-1);
  auto rows = at::empty({flat.numel(), dim}, at::kDouble);
  for (int64_t i = 0; i < flat.numel(); ++i) {
    initialize_row(initializer, flat.data_ptr<int64_t>()[i], rows.data_ptr<double>() + i * dim, dim);
  }
  return rows;
}

void initialize_row(const RowInitializer& initializer, int64_t id, double* out, int64_t dim) {
  std::mt19937_64 generator(splitmix64(initializer.seed ^ splitmix64(static_cast<uint64_t>(id))));
  switch (initializer.kind) {
    case RowInitializer::Kind::Zeros:
      std::fill(out, out + dim, 0.0);
      break;
    case RowInitializer::Kind::Uniform: {
      std::uniform_real_distribution<double> uniform(initializer.a, initializer.b);
      for (int64_t i = 0; i < dim; ++i) out[i] = uniform(generator);
      break;
    }
    case RowInitializer::Kind::Normal: {
      std::normal_distribution<double> normal(initializer.a, initializer.b);
      for (int64_t i = 0; i < dim; ++i) out[i] = normal(generator);
      break;
    }
  }
}

SparseTable::SparseTable(std::string name, c10::ScalarType dtype, int64_t num_rows, int64_t dim,
                         RowInitializer initializer, OptimizerConfig optimizer, int num_workers)
    : Table(std::move(name), dtype, optimizer, num_workers),
      num_rows_(num_rows),
      dim_(dim),
      initializer_(initializer) {
  check_row_optimizer(optimizer, this->name());
  values_ = at::zeros({0, dim}, at::TensorOptions().dtype(dtype));
  if (optimizer.kind == OptimizerConfig::Kind::Adagrad) {
    state_.sum = values_.clone();
  } else if (optimizer.kind == OptimizerConfig::Kind::Adam) {
    state_.exp_avg = values_.clone();
    state_.exp_avg_sq = values_.clone();
    state_.step = at::zeros({0}, at::kLong);
  }
}

int64_t SparseTable::bytes() const {
  int64_t total = values_.nbytes() + static_cast<int64_t>(ids_.capacity() * sizeof(int64_t)) +
                  static_cast<int64_t>(slot_of_.bucket_count() * (sizeof(std::pair<int64_t, int64_t>) + 8));
  for (const auto* tensor : {&state_.sum, &state_.exp_avg, &state_.exp_avg_sq, &state_.step}) {
    total += tensor->defined() ? tensor->nbytes() : 0;
  }
  return total;
}

void SparseTable::grow(int64_t rows) {
  const int64_t capacity = values_.size(0);
  if (rows <= capacity) {
    return;
  }
  const int64_t row_bytes = dim_ * static_cast<int64_t>(c10::elementSize(dtype()));
  const int64_t initial = std::clamp<int64_t>(kInitialBytes / std::max<int64_t>(row_bytes, 1), 1, kInitialCapacity);
  const int64_t wanted = std::max({rows, 2 * capacity, initial});
  values_ = grown(values_, wanted);
  state_.sum = grown(state_.sum, wanted);
  state_.exp_avg = grown(state_.exp_avg, wanted);
  state_.exp_avg_sq = grown(state_.exp_avg_sq, wanted);
  state_.step = grown(state_.step, wanted);
}

at::Tensor SparseTable::slots_of(const int64_t* ids, int64_t count) {
  auto slots = at::empty({count}, at::kLong);
  auto* out = slots.data_ptr<int64_t>();
  const auto first_new = static_cast<int64_t>(ids_.size());
  for (int64_t i = 0; i < count; ++i) {
    auto [entry, created] = slot_of_.emplace(ids[i], static_cast<int64_t>(ids_.size()));
    if (created) {
      ids_.push_back(ids[i]);
    }
    out[i] = entry->second;
  }
  // New rows take the slots after the old ones: initialized together and stored with one copy, as a
  // tensor operation per row would cost more than the row itself.
  const int64_t created = static_cast<int64_t>(ids_.size()) - first_new;
  if (created > 0) {
    grow(static_cast<int64_t>(ids_.size()));
    values_.narrow(0, first_new, created).copy_(initial_rows(initializer_, at::from_blob(ids_.data() + first_new,
                                                                                         {created}, at::kLong),
                                                             dim_));
    if (state_.sum.defined()) {
      state_.sum.narrow(0, first_new, created).fill_(optimizer().initial_accumulator);
    }
  }
  return slots;
}

at::Tensor SparseTable::read_rows(const int64_t* ids, int64_t count) {
  return values_.index_select(0, slots_of(ids, count));
}

void SparseTable::apply_mean(const std::vector<at::Tensor>& ids, const std::vector<at::Tensor>& grads) {
  const auto all_ids = ids.size() == 1 ? ids.front() : at::cat(ids);
  const auto all_grads = grads.size() == 1 ? grads.front() : at::cat(grads);
  const auto distinct = distinct_ids(all_ids.const_data_ptr<int64_t>(), all_ids.numel());
  auto summed = sum_rows(all_grads, distinct.inverse, static_cast<int64_t>(distinct.ids.size()));
  if (grads.size() > 1) {
    summed.div_(static_cast<double>(grads.size()));
  }
  const auto slots = slots_of(distinct.ids.data(), static_cast<int64_t>(distinct.ids.size()));
  auto rows = values_.index_select(0, slots);
  RowOptimizerState gathered;
  if (state_.sum.defined()) gathered.sum = state_.sum.index_select(0, slots);
  if (state_.exp_avg.defined()) {
    gathered.exp_avg = state_.exp_avg.index_select(0, slots);
    gathered.exp_avg_sq = state_.exp_avg_sq.index_select(0, slots);
    gathered.step = state_.step.index_select(0, slots);
  }
  apply_rows(optimizer(), rows, summed, gathered);
  values_.index_copy_(0, slots, rows);
  if (gathered.sum.defined()) state_.sum.index_copy_(0, slots, gathered.sum);
  if (gathered.exp_avg.defined()) {
    state_.exp_avg.index_copy_(0, slots, gathered.exp_avg);
    state_.exp_avg_sq.index_copy_(0, slots, gathered.exp_avg_sq);
    state_.step.index_copy_(0, slots, gathered.step);
  }
}

c10::impl::GenericDict SparseTable::snapshot() const {
  auto state = Table::snapshot();
  const int64_t touched = touched_rows();
  state.insert("ids", at::from_blob(const_cast<int64_t*>(ids_.data()), {touched}, at::kLong).clone());
  state.insert("values", values_.narrow(0, 0, touched).clone());
  for (auto [key, tensor] : {std::pair{"sum", &state_.sum}, std::pair{"exp_avg", &state_.exp_avg},
                             std::pair{"exp_avg_sq", &state_.exp_avg_sq}, std::pair{"step", &state_.step}}) {
    state.insert(key, tensor->defined() ? c10::IValue(tensor->narrow(0, 0, touched).clone()) : c10::IValue());
  }
  return state;
}

void SparseTable::restore(const c10::impl::GenericDict& state) {
  Table::restore(state);
  const auto ids = state.at("ids").toTensor();
  const auto values = state.at("values").toTensor();
  TORCH_CHECK(values.dim() == 2 && values.size(1) == dim_ && values.scalar_type() == dtype(),
              "torchpar.ps: the checkpoint of sparse table '", name(), "' holds rows ", values.sizes(), " ",
              c10::toString(values.scalar_type()), ", the table has rows of ", dim_, " ", c10::toString(dtype()));
  const int64_t touched = ids.numel();
  TORCH_CHECK(ids_.empty(), "torchpar.ps: sparse table '", name(), "' restored after rows were touched");
  ids_.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + touched);
  for (int64_t slot = 0; slot < touched; ++slot) {
    slot_of_[ids_[slot]] = slot;
  }
  grow(touched);
  values_.narrow(0, 0, touched).copy_(values);
  for (auto [key, tensor] : {std::pair{"sum", &state_.sum}, std::pair{"exp_avg", &state_.exp_avg},
                             std::pair{"exp_avg_sq", &state_.exp_avg_sq}, std::pair{"step", &state_.step}}) {
    if (tensor->defined()) {
      tensor->narrow(0, 0, touched).copy_(state.at(key).toTensor());
    }
  }
}

} // namespace torchpar::ps
