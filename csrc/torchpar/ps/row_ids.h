#pragma once
// Row ids of a sparse operation: each distinct id once (the worker reads and pushes it once, the
// server applies it once), and the gradients of repeated ids summed into their row.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace torchpar::ps {

// Distinct ids in first-seen order and, per position of `ids`, the index of its id among them.
struct DistinctIds {
  std::vector<int64_t> ids;
  at::Tensor inverse;  // int64 [count]
};
DistinctIds distinct_ids(const int64_t* ids, int64_t count);

// [distinct, dim] rows: row k the sum of the rows of `rows` ([count, dim], float or double) whose
// inverse is k, added in order of position.
at::Tensor sum_rows(const at::Tensor& rows, const at::Tensor& inverse, int64_t distinct);

} // namespace torchpar::ps
