#pragma once
#include <string>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace torchpar::comm {

// A c10d process group that reports its default backend's own name. c10d's reports the name of a
// BackendType, "custom" for every backend outside torch, and torch's DDP logging, debug output and
// users' checks then say "custom" where torch.distributed.get_backend says "shm".
class NamedProcessGroup : public c10d::ProcessGroup {
 public:
  NamedProcessGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::string backend_name)
      : ProcessGroup(store, rank, size), backend_name_(std::move(backend_name)) {}

  const std::string getBackendName() const override {
    return backend_name_;
  }

 private:
  std::string backend_name_;
};

} // namespace torchpar::comm
