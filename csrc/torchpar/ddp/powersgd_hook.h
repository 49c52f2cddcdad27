// PowerSGD gradient compression (Vogels et al., NeurIPS 2019) as a DDP communication hook: each
// gradient matrix M (n x m) is sent as two rank-r factors P (n x r) and Q (m x r), with error feedback
// (what compression lost is added to the next iteration's gradient) and warm start (Q is reused).
#pragma once
#include <torchpar/common/c10d_fwd.h>

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <c10/core/thread_pool.h>

#include <cstdint>
#include <map>
#include <mutex>

namespace torchpar::ddp {

struct PowerSGDOptions {
  TORCH_ARG(int64_t, matrix_approximation_rank) = 1;
  // Plain all-reduce for the first iterations (torch's default too): compressing a model that still
  // changes fast hurts accuracy.
  TORCH_ARG(int64_t, start_powerSGD_iter) = 1000;
  // Compress a matrix only when that shrinks it at least this much (small ones go uncompressed).
  TORCH_ARG(double, min_compression_rate) = 2.0;
  TORCH_ARG(bool, use_error_feedback) = true;
  TORCH_ARG(bool, warm_start) = true;
  // Every rank draws the same initial Q from this seed.
  TORCH_ARG(uint64_t, seed) = 0;
};

class PowerSGDHook : public c10d::CommHookInterface {
 public:
  PowerSGDHook(c10::intrusive_ptr<c10d::ProcessGroup> group, PowerSGDOptions options = {});
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override;

 private:
  struct BucketState {
    at::Tensor error;            // error feedback, shaped like the bucket
    std::vector<at::Tensor> qs;  // warm-start Q per compressed matrix
  };
  void compress_and_reduce(size_t bucket_index, at::Tensor buffer, std::vector<at::Tensor> gradients);
  at::Tensor all_reduce_sum(at::Tensor tensor);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  PowerSGDOptions options_;
  int64_t iteration_ = 0;
  std::map<size_t, BucketState> states_;
  // PowerSGD needs two dependent all-reduces per bucket. One worker issues them for all buckets in
  // bucket order, so every rank issues the same collective sequence while backward continues.
  c10::ThreadPool worker_{1};
};

} // namespace torchpar::ddp
