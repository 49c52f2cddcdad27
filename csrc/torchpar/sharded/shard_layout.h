// Where each trained parameter's elements lie once sharded over a data-parallel group: gradient buckets
// (as DDP's, in backward order), each bucket padded to a multiple of the group size and cut into equal
// pieces, rank r owning piece r of every bucket. A rank's shard of a dtype is its pieces of that dtype's
// buckets, one after the other: what its optimizer steps and what its averaged gradient fills. Pure.
#pragma once
#include <torchpar/common/bucket_assignment.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace torchpar::sharded {

struct ShardSlot {
  size_t parameter = 0;  // index into the parameters given
  int64_t offset = 0;    // first element in its bucket
  int64_t numel = 0;
};

struct ShardBucket {
  c10::ScalarType dtype = c10::ScalarType::Float;
  int unit = -1;  // stage 3: the unit whose parameters these are (-1: buckets by size)
  std::vector<ShardSlot> slots;
  int64_t padded_numel = 0;  // the slots' elements, then zeros up to a multiple of the group size
  int64_t piece_numel = 0;   // padded_numel / world: each rank's piece
  int64_t shard_offset = 0;  // where this bucket's piece starts in the rank's shard of its dtype
};

struct ShardLayout {
  int world = 1;
  std::vector<ShardBucket> buckets;  // in the order their gradients are reduced
  // One entry per dtype present, in order of first appearance: the shard's dtype and length.
  std::vector<std::pair<c10::ScalarType, int64_t>> shards;
  std::vector<std::pair<size_t, size_t>> location;  // parameter -> (bucket, slot)

  size_t shard_index(c10::ScalarType dtype) const;
  // The bytes one rank's ring reduce-scatter of every bucket sends, (world - 1) / world of the padded
  // buckets, which is also what the all-gather of the updated parameters sends.
  int64_t reduce_scatter_bytes() const;
};

// The part of a trained parameter in one rank's shard: its flattened elements [parameter_offset, + numel), at
// shard_offset in that rank's shard of the parameter's dtype.
struct ShardPiece {
  size_t parameter = 0;
  int64_t parameter_offset = 0;
  int64_t shard_offset = 0;
  int64_t numel = 0;
};

// Rank `rank`'s pieces in its shard `shard` (an index into layout.shards), in shard order: what a checkpoint of
// that rank's shard holds of each parameter. The shard's other elements are padding.
std::vector<ShardPiece> pieces_of(const ShardLayout& layout, size_t shard, int rank);

// `numels` and `dtypes` of the trained parameters, the order their gradients are expected in (see
// reverse_registration_order), the buckets' byte caps in the order they fill (the last repeats, as DDP's: a small
// first one sends the last layers' gradients early in backward), the group's size.
ShardLayout build_shard_layout(const std::vector<int64_t>& numels, const std::vector<c10::ScalarType>& dtypes,
                               const std::vector<size_t>& order, const std::vector<size_t>& bucket_caps_bytes,
                               int world);

// Stage 3: one bucket per unit and dtype, units in backward order (the last unit's first); `unit_of[i]` is
// parameter i's unit in 0..units-1, in forward order.
ShardLayout build_unit_layout(const std::vector<int64_t>& numels, const std::vector<c10::ScalarType>& dtypes,
                              const std::vector<int>& unit_of, int units, int world);

} // namespace torchpar::sharded
