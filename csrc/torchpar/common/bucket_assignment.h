// Which parameters share a gradient bucket: a pure function, tested alone (no process group).
#pragma once
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace torchpar {

struct BucketableParameter {
  size_t bytes = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
};

// Groups parameter indices into buckets, visiting `order` (indices into `parameters`) front to back:
// a bucket closes once it holds at least its byte cap. Bucket k's cap is `bucket_caps_bytes[k]`, the
// last entry serving every later bucket: DDP's {1 MiB, 25 MiB} makes the first bucket small, so the
// first all-reduce starts early in backward. Parameters of different dtypes never share a bucket (one
// flat tensor each). Buckets come out in the order they close, which is the order they are all-reduced.
std::vector<std::vector<size_t>> assign_buckets(
    const std::vector<BucketableParameter>& parameters,
    const std::vector<size_t>& order,
    const std::vector<size_t>& bucket_caps_bytes);

// DDP's caps for assign_buckets: the first bucket's (never above the others'), then every later one's.
std::vector<size_t> first_and_later_caps(size_t first_bucket_bytes, size_t bucket_bytes);

// Reverse registration order: gradients of the last layers are produced first in backward.
std::vector<size_t> reverse_registration_order(size_t count);

} // namespace torchpar
