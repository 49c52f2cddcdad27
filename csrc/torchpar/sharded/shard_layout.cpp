#include <torchpar/sharded/shard_layout.h>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace torchpar::sharded {

size_t ShardLayout::shard_index(c10::ScalarType dtype) const {
  for (size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].first == dtype) return i;
  }
  TORCH_CHECK(false, "sharded: no shard of dtype ", dtype);
}

int64_t ShardLayout::reduce_scatter_bytes() const {
  int64_t bytes = 0;
  for (const auto& bucket : buckets) {
    bytes += bucket.padded_numel / world * (world - 1) * static_cast<int64_t>(c10::elementSize(bucket.dtype));
  }
  return bytes;
}

ShardLayout build_shard_layout(const std::vector<int64_t>& numels, const std::vector<c10::ScalarType>& dtypes,
                               const std::vector<size_t>& order, size_t bucket_cap_bytes, int world) {
  TORCH_CHECK(world >= 1, "sharded: a group of ", world, " ranks");
  TORCH_CHECK(numels.size() == dtypes.size(), "sharded: ", numels.size(), " sizes for ", dtypes.size(), " dtypes");
  std::vector<BucketableParameter> bucketable;
  for (size_t i = 0; i < numels.size(); ++i) {
    bucketable.push_back({static_cast<size_t>(numels[i]) * c10::elementSize(dtypes[i]), dtypes[i]});
  }
  ShardLayout layout;
  layout.world = world;
  layout.location.resize(numels.size());
  for (auto& indices : assign_buckets(bucketable, order, {bucket_cap_bytes})) {
    ShardBucket bucket;
    bucket.dtype = dtypes[indices.front()];
    int64_t offset = 0;
    for (size_t index : indices) {
      layout.location[index] = {layout.buckets.size(), bucket.slots.size()};
      bucket.slots.push_back({index, offset, numels[index]});
      offset += numels[index];
    }
    bucket.padded_numel = (offset + world - 1) / world * world;
    bucket.piece_numel = bucket.padded_numel / world;
    auto shard = std::find_if(layout.shards.begin(), layout.shards.end(),
                              [&](const auto& entry) { return entry.first == bucket.dtype; });
    if (shard == layout.shards.end()) {
      layout.shards.emplace_back(bucket.dtype, 0);
      shard = std::prev(layout.shards.end());
    }
    bucket.shard_offset = shard->second;
    shard->second += bucket.piece_numel;
    layout.buckets.push_back(std::move(bucket));
  }
  return layout;
}

} // namespace torchpar::sharded
