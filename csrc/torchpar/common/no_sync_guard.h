// A data-parallel wrapper's gradient synchronisation off for a scope, restored when it ends (torch's
// `with model.no_sync():`): backward passes inside accumulate gradients locally.
#pragma once

namespace torchpar {

// `Coordinator` has grad_sync() and set_grad_sync(bool) (DDP's and sharded data parallelism's).
template <typename Coordinator>
class NoSyncGuard {
 public:
  explicit NoSyncGuard(Coordinator& coordinator) : coordinator_(coordinator), previous_(coordinator.grad_sync()) {
    coordinator_.set_grad_sync(false);
  }
  ~NoSyncGuard() { coordinator_.set_grad_sync(previous_); }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  Coordinator& coordinator_;
  bool previous_;
};

} // namespace torchpar
