#pragma once
#include <cstdint>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace at {
class Tensor;
} // namespace at

namespace torchpar::comm::shm {

// Throws a c10::Error naming the op when `op` cannot reduce `dtype` (e.g. AVG of booleans).
void check_reducible(c10::ScalarType dtype, c10d::ReduceOp::RedOpType op, const char* op_name);

// destination[i] = sources[0][i] (op) sources[1][i] (op) ... for i < count, in rank order so every
// rank computes bit-identical results, and the same into `copy` unless it is null. float16/bfloat16
// accumulate in float32. AVG divides by the number of sources; integers truncate toward zero (the wrapped
// sum divided, as NCCL averages integers). `destination` and `copy` may each be
// one of the sources itself (in place), but must not overlap one partially.
void reduce_slices(
    void* destination,
    void* copy,
    const std::vector<const void*>& sources,
    int64_t count,
    c10::ScalarType dtype,
    c10d::ReduceOp::RedOpType op);

// tensor /= count in place, integers truncated toward zero: what AVG does after a sum.
void divide_by_count(const at::Tensor& tensor, int64_t count);

} // namespace torchpar::comm::shm
