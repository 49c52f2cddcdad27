#pragma once
#include <cstdint>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace torchpar::comm::shm {

// Throws a c10::Error naming the op when `op` cannot reduce `dtype` (e.g. AVG of integers).
void check_reducible(c10::ScalarType dtype, c10d::ReduceOp::RedOpType op, const char* op_name);

// destination[i] = sources[0][i] (op) sources[1][i] (op) ... for i < count, in rank order so every
// rank computes bit-identical results, and the same into `copy` unless it is null. float16/bfloat16
// accumulate in float32. AVG divides by the number of sources. `destination` and `copy` may each be
// one of the sources itself (in place), but must not overlap one partially.
void reduce_slices(
    void* destination,
    void* copy,
    const std::vector<const void*>& sources,
    int64_t count,
    c10::ScalarType dtype,
    c10d::ReduceOp::RedOpType op);

} // namespace torchpar::comm::shm
