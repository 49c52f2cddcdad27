// The most CPU tensor memory a rank holds while it trains, by the allocator's count (torchpar::cpu_allocations):
// what torchpar's planner predicts per rank, the data loaded before aside. The examples print the fullest rank's.
#pragma once
#include <cstdint>
#include <vector>

#include <ATen/ops/tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torchpar/common/cpu_allocations.h>

class TensorPeak {
 public:
  // Counts from here on, beyond what is held now.
  TensorPeak() {
    torchpar::count_cpu_allocations();
    held_ = torchpar::cpu_allocations().current;
    torchpar::reset_cpu_allocation_peak();
  }

  int64_t bytes() const { return torchpar::cpu_allocations().peak - held_; }

  // The largest rank's bytes(); every rank of `group` calls it.
  int64_t fullest_rank(const c10::intrusive_ptr<c10d::ProcessGroup>& group) const {
    std::vector<at::Tensor> peak{at::tensor({bytes()})};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::MAX;
    group->allreduce(peak, options)->wait();
    return peak[0].item<int64_t>();
  }

 private:
  int64_t held_ = 0;
};
