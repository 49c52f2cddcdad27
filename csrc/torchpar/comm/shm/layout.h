#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace torchpar::comm::shm {

constexpr std::size_t kCacheLine = 64;

// What a rank is about to do; every rank publishes one per op and checks all of them, so calls
// that do not match across ranks (op, dtype, size, root) are reported on every rank.
struct OpDescriptor {
  uint64_t sequence; // per group, counted from 1
  uint32_t op; // OpKind
  int32_t dtype; // at::ScalarType
  int64_t root;
  uint32_t reduce_op; // c10d::ReduceOp::RedOpType
  uint64_t agreed_bytes; // must be equal on every rank
  uint64_t stream_bytes; // this rank's contribution; may differ (alltoall with uneven splits)
};

// One per rank, each hot word on its own cache line so that ranks polling it do not disturb
// the writer of the next one.
struct RankControl {
  alignas(kCacheLine) std::atomic<uint32_t> progress; // phases completed; the futex word
  alignas(kCacheLine) std::atomic<uint32_t> sleepers; // ranks asleep on `progress`
  int32_t pid;
  uint64_t pid_namespace; // pid is only meaningful to ranks in the same namespace
  // Indexed by op sequence parity: a rank may start op n+1 while a slower one still reads op n's.
  alignas(kCacheLine) OpDescriptor descriptors[2];
};

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free atomics");

// Buffer sets a round rotates over: a rank fills round k + 1's slot while others still read round k's,
// and an all-reduce copies round k's reduced partitions out during round k + 1 (see Communicator).
constexpr std::size_t kBufferSets = 3;
// Bytes per rank and round: a piece small enough that a round's copies and reductions stay in a
// core's cache. Measured on 2 cores, 2 ranks: 256 and 512 KiB took 1-4 MiB all-reduces 20-30% below
// 1 MiB pieces; 128 KiB meets too often.
constexpr std::size_t kChunkBytes = 512 << 10;

// Where things are in a group's segment: the controls, then kBufferSets buffer sets (one per round,
// in turn), each one slot of `chunk_bytes` per rank.
struct SegmentLayout {
  int world;
  std::size_t chunk_bytes;

  std::size_t controls_offset() const {
    return 0;
  }
  std::size_t data_offset() const {
    const std::size_t controls = sizeof(RankControl) * static_cast<std::size_t>(world);
    return (controls + 4095) / 4096 * 4096;
  }
  std::size_t slot_offset(uint64_t round, int rank) const {
    return data_offset() + ((round % kBufferSets) * static_cast<std::size_t>(world) + static_cast<std::size_t>(rank)) * chunk_bytes;
  }
  std::size_t total_bytes() const {
    return data_offset() + kBufferSets * static_cast<std::size_t>(world) * chunk_bytes;
  }
};

} // namespace torchpar::comm::shm
