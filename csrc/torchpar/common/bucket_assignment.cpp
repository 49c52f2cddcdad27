#include <torchpar/common/bucket_assignment.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <numeric>

namespace torchpar {

std::vector<std::vector<size_t>> assign_buckets(
    const std::vector<BucketableParameter>& parameters,
    const std::vector<size_t>& order,
    const std::vector<size_t>& bucket_caps_bytes) {
  TORCH_CHECK(!bucket_caps_bytes.empty(), "assign_buckets: no bucket cap given");
  TORCH_CHECK(
      order.size() == parameters.size(),
      "assign_buckets: the order names ", order.size(), " parameters, but there are ", parameters.size());
  struct OpenBucket {
    std::vector<size_t> indices;
    size_t bytes = 0;
  };
  std::map<c10::ScalarType, OpenBucket> open_by_dtype;
  std::vector<std::vector<size_t>> closed;
  std::vector<bool> seen(parameters.size(), false);
  for (size_t index : order) {
    TORCH_CHECK(
        index < parameters.size() && !seen[index],
        "assign_buckets: the order is not a permutation of 0..", parameters.size() - 1,
        " (index ", index, ")");
    seen[index] = true;
    OpenBucket& bucket = open_by_dtype[parameters[index].dtype];
    bucket.indices.push_back(index);
    bucket.bytes += parameters[index].bytes;
    const size_t cap = bucket_caps_bytes[std::min(closed.size(), bucket_caps_bytes.size() - 1)];
    if (bucket.bytes >= cap) {
      closed.push_back(std::move(bucket.indices));
      bucket = OpenBucket{};
    }
  }
  // Leftover partial buckets close in the order of their first parameter, i.e. visiting order.
  std::vector<std::vector<size_t>> leftovers;
  for (auto& [dtype, bucket] : open_by_dtype) {
    if (!bucket.indices.empty()) {
      leftovers.push_back(std::move(bucket.indices));
    }
  }
  std::vector<size_t> position(parameters.size());
  for (size_t i = 0; i < order.size(); ++i) {
    position[order[i]] = i;
  }
  std::sort(leftovers.begin(), leftovers.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });
  for (auto& bucket : leftovers) {
    closed.push_back(std::move(bucket));
  }
  return closed;
}

std::vector<size_t> first_and_later_caps(size_t first_bucket_bytes, size_t bucket_bytes) {
  return {std::min(first_bucket_bytes, bucket_bytes), bucket_bytes};
}

std::vector<size_t> reverse_registration_order(size_t count) {
  std::vector<size_t> order(count);
  std::iota(order.rbegin(), order.rend(), size_t{0});
  return order;
}

} // namespace torchpar
