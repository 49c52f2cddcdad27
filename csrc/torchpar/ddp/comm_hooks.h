// Communication hooks: what DistributedDataParallel does with each full gradient bucket.
// Each returns a future holding the bucket's reduced, averaged contents (torch's comm-hook contract).
#pragma once
#include <torchpar/common/c10d_fwd.h>

#include <ATen/core/ivalue.h>

#include <functional>
#include <memory>
#include <string>

namespace c10d {
class CommHookInterface;
class GradBucket;
} // namespace c10d

namespace torchpar::ddp {

using CommHookFunction = std::function<c10::intrusive_ptr<c10::ivalue::Future>(c10d::GradBucket&)>;

// Average in full precision (what DDP does without a hook; useful as a base for user hooks).
std::unique_ptr<c10d::CommHookInterface> allreduce_hook(c10::intrusive_ptr<c10d::ProcessGroup> group);
// Halve the bytes on the wire: cast to float16 / bfloat16, all-reduce, cast back.
std::unique_ptr<c10d::CommHookInterface> fp16_compress_hook(c10::intrusive_ptr<c10d::ProcessGroup> group);
std::unique_ptr<c10d::CommHookInterface> bf16_compress_hook(c10::intrusive_ptr<c10d::ProcessGroup> group);
// A built-in hook by its name ("allreduce", "fp16", "bf16"), as the Python face names them; throws
// for any other name, listing the known ones.
std::unique_ptr<c10d::CommHookInterface> builtin_comm_hook(const std::string& name,
                                                           c10::intrusive_ptr<c10d::ProcessGroup> group);
// A user's callable: receives the bucket (raw local gradients), returns the future of its average.
// (c10d::GradBucket is defined in <torch/csrc/distributed/c10d/comm.hpp>.)
std::unique_ptr<c10d::CommHookInterface> function_hook(CommHookFunction hook);

} // namespace torchpar::ddp
