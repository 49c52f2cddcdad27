#include <torchpar/comm/shm/shm_work.h>

#include <ATen/core/jit_type.h>

namespace torchpar::comm::shm {

ShmWork::ShmWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
    : Work(rank, type),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

c10::intrusive_ptr<c10::ivalue::Future> ShmWork::getFuture() {
  return future_;
}

std::vector<at::Tensor> ShmWork::result() {
  return outputs_;
}

void ShmWork::complete() {
  future_->markCompleted(c10::IValue(outputs_));
  finish();
}

void ShmWork::fail(const std::exception_ptr& error) {
  future_->setError(error);
  finish(error);
}

} // namespace torchpar::comm::shm
