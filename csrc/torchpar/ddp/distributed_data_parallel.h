// DistributedDataParallel for LibTorch C++ modules. A training loop changes two lines:
//
//   auto model = Net();
//   auto ddp = torchpar::ddp::DistributedDataParallel(model,
//       torchpar::ddp::DistributedDataParallelOptions().process_group(group));
//   ...
//   auto loss = torch::nll_loss(ddp(batch.data), batch.target);   // was model->forward(...)
//   loss.backward();                                                // gradients arrive averaged
//
// The wrapped module keeps its parameters; the optimizer is built on model->parameters() as usual.
#pragma once
#include <torchpar/common/module_tensors.h>
#include <torchpar/common/no_sync_guard.h>
#include <torchpar/ddp/options.h>
#include <torchpar/ddp/replica_coordinator.h>

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace torchpar::ddp {

namespace detail {
inline void collect_tensors(const at::Tensor& tensor, std::vector<at::Tensor>& out) {
  out.push_back(tensor);
}
inline void collect_tensors(const std::vector<at::Tensor>& tensors, std::vector<at::Tensor>& out) {
  out.insert(out.end(), tensors.begin(), tensors.end());
}
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& tuple, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... element) { (collect_tensors(element, out), ...); }, tuple);
}
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& pair, std::vector<at::Tensor>& out) {
  collect_tensors(pair.first, out);
  collect_tensors(pair.second, out);
}
// Other output types hold no tensors DDP can see; find_unused_parameters then reports every
// parameter as unused, so return tensors (or tuples/vectors of them) from forward when using it.
template <typename T>
void collect_tensors(const T&, std::vector<at::Tensor>&) {}
} // namespace detail

using NoSyncGuard = torchpar::NoSyncGuard<ReplicaCoordinator>;

// `ModuleHolder` is a LibTorch module holder (torch::nn::Sequential, or a TORCH_MODULE(Net) type).
template <typename ModuleHolder>
class DistributedDataParallel {
 public:
  DistributedDataParallel(ModuleHolder module, DistributedDataParallelOptions options)
      : module_(std::move(module)),
        coordinator_(std::make_unique<ReplicaCoordinator>(
            named_parameters_of(*module_), named_buffers_of(*module_), std::move(options))) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    const bool will_sync = coordinator_->will_sync();
    coordinator_->pre_forward(will_sync);
    auto output = module_->forward(std::forward<Args>(args)...);
    std::vector<at::Tensor> tensors;
    if (will_sync) {
      detail::collect_tensors(output, tensors);
    }
    coordinator_->post_forward(tensors, will_sync);
    return output;
  }

  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // Gradients accumulate locally while the guard lives; the next synchronised backward all-reduces the sum.
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*coordinator_); }

  // Uneven inputs: runs `train_loop` (this rank's iterations, however many); afterwards this rank
  // shadows the collectives of ranks still training until all are done, then every rank holds the
  // model of the rank that trained longest.
  void join(const std::function<void()>& train_loop) {
    coordinator_->begin_join();
    try {
      train_loop();
    } catch (...) {
      coordinator_->cancel_join();
      throw;
    }
    coordinator_->finish_join();
  }

  // Replaces the default all-reduce; see comm_hooks.h and powersgd_hook.h.
  void register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook) {
    coordinator_->register_comm_hook(std::move(hook));
  }

  ModuleHolder& module() { return module_; }
  typename ModuleHolder::ContainedType* operator->() { return module_.get(); }
  ReplicaCoordinator& coordinator() { return *coordinator_; }

 private:
  ModuleHolder module_;
  std::unique_ptr<ReplicaCoordinator> coordinator_;
};

} // namespace torchpar::ddp
