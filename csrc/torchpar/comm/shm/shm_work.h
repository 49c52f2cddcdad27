#pragma once
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace torchpar::comm::shm {

// Ops the backend's thread ran, kept until a caller's thread releases them: an op's tensors may be Python's,
// and dropping the last reference takes the GIL, which a caller can hold while it waits for that thread
// (destroy_process_group joins it). The next op's caller releases them, and so does whoever waits on a work.
class FinishedTasks {
 public:
  void add(std::function<void()> task);
  void release();  // on the calling thread

 private:
  std::mutex mutex_;
  std::vector<std::function<void()>> tasks_;
};

// One op of the shm backend: completed by the backend's thread, waited on by the caller. Its
// future carries the output tensors, so torch's DDP comm hooks and `Work.get_future()` work.
class ShmWork : public c10d::Work {
 public:
  ShmWork(int rank, c10d::OpType type, uint64_t sequence_number, std::vector<at::Tensor> outputs,
          std::shared_ptr<FinishedTasks> finished = nullptr);

  // Also releases the finished ops' tensors: otherwise the last op before a pause (DDP's last bucket: the
  // gradients it averaged in place) holds them until the next op, past zero_grad and into the next backward.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;

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
  std::shared_ptr<FinishedTasks> finished_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace torchpar::comm::shm
