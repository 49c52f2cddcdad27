#include <torchpar/ddp/comm_hooks.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

namespace torchpar::ddp {
namespace {

class CompressedAllreduceHook : public c10d::CommHookInterface {
 public:
  // `wire_dtype` undefined = no compression.
  CompressedAllreduceHook(c10::intrusive_ptr<c10d::ProcessGroup> group, std::optional<at::ScalarType> wire_dtype)
      : group_(std::move(group)), wire_dtype_(wire_dtype) {
    TORCH_CHECK(group_, "communication hook: no process group given");
  }

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    auto buffer = bucket.getBuffer();
    // Dividing before the sum keeps float16 from overflowing where the sum would.
    auto on_wire = wire_dtype_ ? buffer.to(*wire_dtype_) : buffer;
    on_wire.div_(group_->getSize());
    std::vector<at::Tensor> tensors{on_wire};
    auto reduced = group_->allreduce(tensors)->getFuture();
    if (!wire_dtype_) {
      return reduced;
    }
    return reduced->then(
        [buffer, on_wire](c10::ivalue::Future&) {
          buffer.copy_(on_wire);
          return c10::IValue(buffer);
        },
        c10::TensorType::get());
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::optional<at::ScalarType> wire_dtype_;
};

class FunctionCommHook : public c10d::CommHookInterface {
 public:
  explicit FunctionCommHook(CommHookFunction hook) : hook_(std::move(hook)) {
    TORCH_CHECK(hook_, "register_comm_hook: the hook is empty");
  }
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    return hook_(bucket);
  }
  at::Tensor parseHookResult(const c10::IValue& result) override {
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  CommHookFunction hook_;
};

} // namespace

std::unique_ptr<c10d::CommHookInterface> allreduce_hook(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  return std::make_unique<CompressedAllreduceHook>(std::move(group), std::nullopt);
}

std::unique_ptr<c10d::CommHookInterface> fp16_compress_hook(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  return std::make_unique<CompressedAllreduceHook>(std::move(group), at::kHalf);
}

std::unique_ptr<c10d::CommHookInterface> bf16_compress_hook(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  return std::make_unique<CompressedAllreduceHook>(std::move(group), at::kBFloat16);
}

std::unique_ptr<c10d::CommHookInterface> builtin_comm_hook(const std::string& name,
                                                           c10::intrusive_ptr<c10d::ProcessGroup> group) {
  if (name == "allreduce") {
    return allreduce_hook(std::move(group));
  }
  if (name == "fp16") {
    return fp16_compress_hook(std::move(group));
  }
  if (name == "bf16") {
    return bf16_compress_hook(std::move(group));
  }
  TORCH_CHECK(false, "register_builtin_comm_hook: unknown hook '", name, "' (allreduce, fp16, bf16)");
}

std::unique_ptr<c10d::CommHookInterface> function_hook(CommHookFunction hook) {
  return std::make_unique<FunctionCommHook>(std::move(hook));
}

} // namespace torchpar::ddp
