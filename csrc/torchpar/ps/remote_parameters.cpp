#include <torchpar/ps/remote_parameters.h>

#include <torchpar/common/bucket_assignment.h>
#include <torchpar/common/gradient_hooks.h>

#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <limits>
#include <numeric>

namespace torchpar::ps {
namespace {

// Frozen parameters (requires_grad false) stay local: no gradient would ever update their table.
std::vector<std::string> trainable_names(const torch::OrderedDict<std::string, at::Tensor>& named_parameters) {
  std::vector<std::string> names;
  for (const auto& item : named_parameters) {
    if (item.value().requires_grad()) names.push_back(item.key());
  }
  return names;
}

std::vector<at::Tensor> trainable_parameters(const torch::OrderedDict<std::string, at::Tensor>& named_parameters) {
  std::vector<at::Tensor> parameters;
  for (const auto& item : named_parameters) {
    if (item.value().requires_grad()) parameters.push_back(item.value());
  }
  return parameters;
}

std::vector<std::vector<size_t>> reverse_order_buckets(const std::vector<at::Tensor>& parameters, size_t cap) {
  std::vector<BucketableParameter> sizes;
  for (const auto& parameter : parameters) {
    sizes.push_back({static_cast<size_t>(parameter.nbytes()), parameter.scalar_type()});
  }
  return assign_buckets(sizes, reverse_registration_order(parameters.size()), {cap});
}

} // namespace

RemoteParameters::RemoteParameters(Client& client, const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                                   const OptimizerConfig& optimizer, const std::string& prefix,
                                   size_t bucket_cap_bytes)
    : client_(client),
      names_(trainable_names(named_parameters)),
      parameters_(trainable_parameters(named_parameters)),
      buckets_(reverse_order_buckets(parameters_, bucket_cap_bytes), names_) {
  for (size_t i = 0; i < parameters_.size(); ++i) {
    tables_.push_back(client_.dense_table(prefix + names_[i], parameters_[i].detach(), optimizer));
  }
  pull();
  hooks_ = std::make_unique<GradientReadyHooks>(parameters_, [this](size_t index) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (const auto bucket = buckets_.gradient_ready(index)) {
      push_bucket(*bucket);
    }
  });
}

RemoteParameters::~RemoteParameters() = default;

void RemoteParameters::push_bucket(size_t bucket) {
  std::vector<int> tables;
  std::vector<at::Tensor> grads;
  for (size_t index : buckets_.buckets()[bucket]) {
    const auto& grad = parameters_[index].grad();
    tables.push_back(tables_[index]);
    grads.push_back(grad.defined() ? grad : at::zeros_like(parameters_[index]));
  }
  in_flight_.emplace_back(bucket, client_.push_pull(tables, grads));
}

void RemoteParameters::assign(const std::vector<size_t>& indices, const c10::List<at::Tensor>& values) {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < indices.size(); ++i) {
    parameters_[indices[i]].copy_(values.get(i));
  }
}

void RemoteParameters::pull() {
  auto future = client_.pull(tables_);
  future->waitAndThrow();
  std::vector<size_t> all(parameters_.size());
  std::iota(all.begin(), all.end(), size_t{0});
  assign(all, future->value().toTensorList());
}

void RemoteParameters::step() {
  std::vector<std::pair<size_t, Future>> in_flight;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t bucket : buckets_.finish_step()) {
      push_bucket(bucket);
    }
    in_flight.swap(in_flight_);
  }
  std::exception_ptr first_error;
  for (auto& [bucket, future] : in_flight) {
    future->wait();
    if (future->hasError()) {
      first_error = first_error ? first_error : future->exception_ptr();
      continue;
    }
    assign(buckets_.buckets()[bucket], future->value().toTensorList());
  }
  for (auto& parameter : parameters_) {
    parameter.mutable_grad() = at::Tensor();
  }
  if (first_error) {
    std::rethrow_exception(first_error);
  }
}

void RemoteParameters::set_learning_rate(double lr) {
  for (int table : tables_) {
    client_.set_learning_rate(table, lr);
  }
}

int64_t RemoteParameters::clock() const {
  int64_t clock = std::numeric_limits<int64_t>::max();
  for (int table : tables_) {
    clock = std::min(clock, client_.clock(table));
  }
  return tables_.empty() ? 0 : clock;
}

std::vector<std::vector<std::string>> RemoteParameters::buckets() const {
  std::vector<std::vector<std::string>> result;
  for (const auto& bucket : buckets_.buckets()) {
    result.emplace_back();
    for (size_t index : bucket) {
      result.back().push_back(names_[index]);
    }
  }
  return result;
}

void RemoteParameters::remove_hooks() {
  std::lock_guard<std::mutex> lock(mutex_);
  hooks_.reset();
}

} // namespace torchpar::ps
