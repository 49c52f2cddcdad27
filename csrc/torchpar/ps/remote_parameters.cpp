#include <torchpar/ps/remote_parameters.h>

#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>

namespace torchpar::ps {

RemoteParameters::RemoteParameters(Client& client, const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                                   const OptimizerConfig& optimizer, const std::string& prefix)
    : client_(client) {
  for (const auto& item : named_parameters) {
    parameters_.push_back(item.value());
    tables_.push_back(client_.dense_table(prefix + item.key(), item.value().detach(), optimizer));
  }
  pull();
}

void RemoteParameters::assign(const c10::List<at::Tensor>& values) {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    parameters_[i].copy_(values.get(i));
  }
}

void RemoteParameters::pull() {
  auto future = client_.pull(tables_);
  future->waitAndThrow();
  assign(future->value().toTensorList());
}

void RemoteParameters::step() {
  std::vector<at::Tensor> grads;
  for (auto& parameter : parameters_) {
    const auto& grad = parameter.grad();
    grads.push_back(grad.defined() ? grad : at::zeros_like(parameter));
  }
  auto future = client_.push_pull(tables_, grads);
  future->waitAndThrow();
  assign(future->value().toTensorList());
  for (auto& parameter : parameters_) {
    parameter.mutable_grad() = at::Tensor();
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

} // namespace torchpar::ps
