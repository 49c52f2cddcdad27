#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <torchpar/comm/shm/layout.h>
#include <torchpar/comm/shm/pieces.h>
#include <torchpar/comm/shm/segment.h>

namespace torchpar::comm::shm {

enum class OpKind : uint32_t {
  Allreduce = 1,
  Broadcast,
  Reduce,
  Allgather,
  Gather,
  Scatter,
  ReduceScatter,
  AllToAll,
  Barrier,
};

const char* op_name(OpKind kind);

// What one op moves: this rank receives `length` bytes from offset `offset` of rank `source`'s
// stream into `destination`.
struct Want {
  int source;
  uint64_t offset;
  uint64_t length;
  char* destination;
};

// Which ranks keep the result of a reduction.
enum class ReduceMode {
  All, // allreduce: every rank, the whole tensor
  Root, // reduce: the root only
  Scatter, // reduce_scatter: each rank its own block [rank*block, (rank+1)*block)
};

// The collectives of one group of ranks on one host, over a shared segment. Every op runs in
// rounds of at most one chunk per rank: each rank copies its chunk into its slot, all ranks meet
// (progress counters), then each takes what it needs straight from the others' slots. Rounds take
// the buffer sets in turn, so a round needs one meeting: an all-reduce, whose ranks each reduce a
// partition of the chunk that the others then copy, copies round k's partitions once round k + 1's
// meeting showed them complete (and only its last round meets twice). Three sets, since a rank
// publishing round k + 2 may meet a slower one still copying round k. Not thread-safe: the backend
// runs its ops one after another on one thread, in the same order on every rank.
class Communicator {
 public:
  Communicator(SharedSegment segment, SegmentLayout layout, int rank, std::chrono::milliseconds timeout);

  int rank() const {
    return rank_;
  }
  int world() const {
    return layout_.world;
  }
  // May be called from another thread than the one running ops.
  void set_timeout(std::chrono::milliseconds timeout) {
    timeout_ms_.store(timeout.count());
  }
  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(timeout_ms_.load());
  }

  // Every rank contributes `stream` (lengths may differ between ranks) and receives `wants`.
  void exchange(OpDescriptor descriptor, const char* stream, uint64_t stream_bytes, const std::vector<Want>& wants);

  // Reduces `input` (contiguous, same numel and dtype on every rank) into `output`: the whole
  // tensor (All, Root) or this rank's block (Scatter, output has numel / world elements).
  void reduce(OpDescriptor descriptor, const at::Tensor& input, const at::Tensor& output, ReduceMode mode,
              c10d::ReduceOp::RedOpType op);
  // The same over elements of `dtype` lying in pieces (the same number of bytes on every rank, however
  // each rank's are split); `output` may be `input` itself.
  void reduce(OpDescriptor descriptor, const Pieces& input, const Pieces& output, c10::ScalarType dtype,
              ReduceMode mode, c10d::ReduceOp::RedOpType op);

 private:
  char* slot(int rank) const;
  char* slot(uint64_t round, int rank) const;
  RankControl& mine() const {
    return controls_[rank_];
  }
  // Copies this rank's part of the current round (`length` bytes of `stream` from `offset`) into its
  // slot, but for bytes [keep_from, keep_to) of it that no other rank reads, then waits for every
  // rank to have done the same (and published the op's descriptor, in the first round).
  void publish(const Pieces& stream, uint64_t offset, uint64_t length, uint64_t keep_from = 0, uint64_t keep_to = 0);
  void meet();
  // After the first round: every rank's descriptor must match; returns the longest stream.
  uint64_t check_descriptors();
  std::string describe() const;
  // Runs an op's rounds. An exception that left the ranks out of step (a timeout, a dead peer, a
  // failure on some ranks only) makes the group unusable; a mismatch found in the first round,
  // which every rank detects alike, does not.
  template <typename Rounds>
  void run(Rounds&& rounds);
  // Starts op `descriptor`: refuses to when an earlier op left the ranks out of step.
  void start_op(OpDescriptor& descriptor, uint64_t stream_bytes);

  SharedSegment segment_;
  SegmentLayout layout_;
  int rank_;
  std::atomic<std::chrono::milliseconds::rep> timeout_ms_;
  RankControl* controls_;
  std::chrono::microseconds spin_for_; // how long a meeting spins before it yields
  uint64_t round_ = 0; // rounds completed by this group; selects the buffer set
  uint32_t phase_ = 0; // this rank's progress counter
  uint64_t sequence_ = 0;
  OpDescriptor current_{};
  std::string failure_; // why the group stopped being usable (a rank died or timed out)
  bool mismatch_ = false; // the current op was abandoned on every rank alike
  std::chrono::steady_clock::time_point deadline_;
};

} // namespace torchpar::comm::shm
