#include <torchpar/ps/dense_table.h>

namespace torchpar::ps {
namespace {

c10::IValue tensor_or_none(const at::Tensor& tensor) {
  return tensor.defined() ? c10::IValue(tensor.clone()) : c10::IValue();
}

at::Tensor tensor_or_undefined(const c10::IValue& value) {
  return value.isNone() ? at::Tensor() : value.toTensor();
}

} // namespace

DenseTable::DenseTable(std::string name, std::vector<int64_t> shape, int64_t shard_begin, int64_t shard_end,
                       at::Tensor values, OptimizerConfig optimizer, int num_workers,
                       std::function<void()> before_change)
    : Table(std::move(name), values.scalar_type(), optimizer, num_workers),
      shape_(std::move(shape)),
      shard_begin_(shard_begin),
      shard_end_(shard_end),
      values_(std::move(values)),
      state_(initial_dense_state(optimizer, values_)),
      before_change_(std::move(before_change)) {}

int64_t DenseTable::bytes() const {
  int64_t total = values_.nbytes();
  for (const auto* tensor : {&state_.momentum_buffer, &state_.sum, &state_.exp_avg, &state_.exp_avg_sq}) {
    total += tensor->defined() ? tensor->nbytes() : 0;
  }
  return total;
}

void DenseTable::apply_mean(const std::vector<at::Tensor>& ids, const std::vector<at::Tensor>& grads) {
  at::Tensor mean = grads.front();
  if (grads.size() > 1) {
    mean = grads.front().clone();
    for (size_t i = 1; i < grads.size(); ++i) {
      mean.add_(grads[i]);
    }
    mean.div_(static_cast<double>(grads.size()));
  }
  if (before_change_) before_change_();
  apply_dense(optimizer(), values_, mean, state_);
}

c10::impl::GenericDict DenseTable::snapshot() const {
  auto state = Table::snapshot();
  state.insert("values", values_.clone());
  state.insert("momentum_buffer", tensor_or_none(state_.momentum_buffer));
  state.insert("sum", tensor_or_none(state_.sum));
  state.insert("exp_avg", tensor_or_none(state_.exp_avg));
  state.insert("exp_avg_sq", tensor_or_none(state_.exp_avg_sq));
  state.insert("step", state_.step);
  return state;
}

void DenseTable::restore(const c10::impl::GenericDict& state) {
  Table::restore(state);
  const auto values = state.at("values").toTensor();
  TORCH_CHECK(values.numel() == numel() && values.scalar_type() == dtype(), "torchpar.ps: the checkpoint of table '",
              name(), "' holds ", values.numel(), " ", c10::toString(values.scalar_type()), " values for a shard of ",
              numel(), " ", c10::toString(dtype()));
  if (before_change_) before_change_();
  values_.copy_(values);
  state_.momentum_buffer = tensor_or_undefined(state.at("momentum_buffer"));
  state_.sum = tensor_or_undefined(state.at("sum"));
  state_.exp_avg = tensor_or_undefined(state.at("exp_avg"));
  state_.exp_avg_sq = tensor_or_undefined(state.at("exp_avg_sq"));
  state_.step = state.at("step").toInt();
}

} // namespace torchpar::ps
