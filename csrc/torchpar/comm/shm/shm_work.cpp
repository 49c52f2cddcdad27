#include <torchpar/comm/shm/shm_work.h>

#include <torchpar/common/error_message.h>

#include <ATen/core/jit_type.h>
#include <c10/util/Logging.h>

namespace torchpar::comm::shm {

void FinishedTasks::add(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(mutex_);
  tasks_.push_back(std::move(task));
}

void FinishedTasks::release() {
  std::vector<std::function<void()>> released;  // dropped on return, outside the lock
  std::lock_guard<std::mutex> lock(mutex_);
  released.swap(tasks_);
}

ShmWork::ShmWork(int rank, c10d::OpType type, uint64_t sequence_number, std::vector<at::Tensor> outputs,
                 std::shared_ptr<FinishedTasks> finished)
    : Work(rank, type),
      sequence_number_(sequence_number),
      outputs_(std::move(outputs)),
      finished_(std::move(finished)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors())) {}

bool ShmWork::wait(std::chrono::milliseconds timeout) {
  const bool done = Work::wait(timeout);
  if (finished_) finished_->release();
  return done;
}

c10::intrusive_ptr<c10::ivalue::Future> ShmWork::getFuture() {
  return future_;
}

// As c10d's Gloo backend: the outputs only once the op finished (a failed op's error comes from wait()).
std::vector<at::Tensor> ShmWork::result() {
  TORCH_CHECK(isCompleted(), "Work needs to be completed before calling result() (shm backend, ",
              c10d::opTypeToString(retrieveOpType()), " on rank ", rank_, "); call wait() first");
  return outputs_;
}

void ShmWork::complete() {
  try {
    future_->markCompleted(c10::IValue(outputs_));
  } catch (const std::exception& e) {
    // A callback the user chained on the future threw; the op itself succeeded.
    LOG(ERROR) << "shm backend: a callback on a completed op's future threw: " << message_of(e);
  }
  finish();
}

void ShmWork::fail(const std::exception_ptr& error) {
  try {
    future_->setError(error);
  } catch (const std::exception& e) {
    LOG(ERROR) << "shm backend: a callback on a failed op's future threw: " << message_of(e);
  }
  finish(error);
}

} // namespace torchpar::comm::shm
