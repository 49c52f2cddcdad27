#pragma once
#include <exception>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace torchpar::comm::shm {

// One op of the shm backend: completed by the backend's thread, waited on by the caller. Its
// future carries the output tensors, so torch's DDP comm hooks and `Work.get_future()` work.
class ShmWork : public c10d::Work {
 public:
  ShmWork(int rank, c10d::OpType type, uint64_t sequence_number, std::vector<at::Tensor> outputs);

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  uint64_t getSequencenumber() const override {
    return sequence_number_;
  }

  void complete();
  void fail(const std::exception_ptr& error);

 private:
  uint64_t sequence_number_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace torchpar::comm::shm
