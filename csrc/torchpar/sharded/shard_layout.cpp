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

std::vector<ShardPiece> pieces_of(const ShardLayout& layout, size_t shard, int rank) {
  TORCH_CHECK(shard < layout.shards.size(), "sharded: no shard ", shard, " (there are ", layout.shards.size(), ")");
  TORCH_CHECK(rank >= 0 && rank < layout.world, "sharded: no rank ", rank, " in a group of ", layout.world);
  std::vector<ShardPiece> pieces;
  for (const auto& bucket : layout.buckets) {
    if (bucket.dtype != layout.shards[shard].first) continue;
    const int64_t piece_start = rank * bucket.piece_numel;
    for (const auto& slot : bucket.slots) {
      const int64_t from = std::max(slot.offset, piece_start);
      const int64_t to = std::min(slot.offset + slot.numel, piece_start + bucket.piece_numel);
      if (from < to) {
        pieces.push_back({slot.parameter, from - slot.offset, bucket.shard_offset + from - piece_start, to - from});
      }
    }
  }
  return pieces;
}

namespace {

// The buckets given as lists of parameter indices, each of one dtype, laid out in that order.
ShardLayout lay_out(const std::vector<std::vector<size_t>>& buckets, const std::vector<int>& units,
                    const std::vector<int64_t>& numels, const std::vector<c10::ScalarType>& dtypes, int world) {
  ShardLayout layout;
  layout.world = world;
  layout.location.resize(numels.size());
  for (size_t b = 0; b < buckets.size(); ++b) {
    const auto& indices = buckets[b];
    ShardBucket bucket;
    bucket.dtype = dtypes[indices.front()];
    bucket.unit = units[b];
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

void check_sizes(const std::vector<int64_t>& numels, const std::vector<c10::ScalarType>& dtypes, int world) {
  TORCH_CHECK(world >= 1, "sharded: a group of ", world, " ranks");
  TORCH_CHECK(numels.size() == dtypes.size(), "sharded: ", numels.size(), " sizes for ", dtypes.size(), " dtypes");
}

} // namespace

ShardLayout build_shard_layout(const std::vector<int64_t>& numels, const std::vector<c10::ScalarType>& dtypes,
                               const std::vector<size_t>& order, const std::vector<size_t>& bucket_caps_bytes,
                               int world) {
  check_sizes(numels, dtypes, world);
  std::vector<BucketableParameter> bucketable;
  for (size_t i = 0; i < numels.size(); ++i) {
    bucketable.push_back({static_cast<size_t>(numels[i]) * c10::elementSize(dtypes[i]), dtypes[i]});
  }
  auto buckets = assign_buckets(bucketable, order, bucket_caps_bytes);
  return lay_out(buckets, std::vector<int>(buckets.size(), -1), numels, dtypes, world);
}

ShardLayout build_unit_layout(const std::vector<int64_t>& numels, const std::vector<c10::ScalarType>& dtypes,
                              const std::vector<int>& unit_of, int units, int world) {
  check_sizes(numels, dtypes, world);
  TORCH_CHECK(unit_of.size() == numels.size(), "sharded: ", unit_of.size(), " units for ", numels.size(),
              " parameters");
  std::vector<std::vector<size_t>> buckets;
  std::vector<int> bucket_units;
  for (int unit = units - 1; unit >= 0; --unit) {
    std::vector<c10::ScalarType> seen;
    for (size_t i = 0; i < numels.size(); ++i) {
      TORCH_CHECK(unit_of[i] >= 0 && unit_of[i] < units, "sharded: parameter ", i, " in unit ", unit_of[i],
                  " of ", units);
      if (unit_of[i] != unit) continue;
      auto known = std::find(seen.begin(), seen.end(), dtypes[i]);
      if (known == seen.end()) {
        seen.push_back(dtypes[i]);
        buckets.emplace_back();
        bucket_units.push_back(unit);
        known = std::prev(seen.end());
      }
      buckets[buckets.size() - seen.size() + static_cast<size_t>(known - seen.begin())].push_back(i);
    }
  }
  return lay_out(buckets, bucket_units, numels, dtypes, world);
}

} // namespace torchpar::sharded
