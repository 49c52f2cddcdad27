#include <torchpar/comm/shm/communicator.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include <c10/util/Exception.h>

#include <torchpar/comm/shm/progress.h>
#include <torchpar/comm/shm/reduce_kernels.h>
#include <torchpar/common/error_message.h>
#include <torchpar/common/process_state.h>

namespace torchpar::comm::shm {
namespace {

// Up to this many bytes every rank reduces the whole message itself: one meeting instead of two.
constexpr uint64_t kOneShotBytes = 64 * 1024;
// Partitions of a chunk start on cache-line boundaries.
constexpr int64_t kPartitionAlignBytes = 64;

uint64_t ceil_div(uint64_t a, uint64_t b) {
  return (a + b - 1) / b;
}

const char* reduce_op_name(uint32_t op) {
  static constexpr const char* kNames[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"};
  return op < sizeof(kNames) / sizeof(kNames[0]) ? kNames[op] : "unknown";
}

std::string describe_descriptor(const OpDescriptor& d) {
  std::ostringstream text;
  text << op_name(static_cast<OpKind>(d.op)) << " of "
       << c10::getDtypeNames(static_cast<c10::ScalarType>(d.dtype)).first << ", " << d.agreed_bytes << " bytes";
  if (d.root >= 0) {
    text << ", root " << d.root;
  }
  if (static_cast<OpKind>(d.op) == OpKind::Allreduce || static_cast<OpKind>(d.op) == OpKind::Reduce ||
      static_cast<OpKind>(d.op) == OpKind::ReduceScatter) {
    text << ", " << reduce_op_name(d.reduce_op);
  }
  return text.str();
}

bool same_call(const OpDescriptor& a, const OpDescriptor& b) {
  return a.sequence == b.sequence && a.op == b.op && a.dtype == b.dtype && a.root == b.root &&
      a.reduce_op == b.reduce_op && a.agreed_bytes == b.agreed_bytes;
}

} // namespace

const char* op_name(OpKind kind) {
  switch (kind) {
    case OpKind::Allreduce:
      return "allreduce";
    case OpKind::Broadcast:
      return "broadcast";
    case OpKind::Reduce:
      return "reduce";
    case OpKind::Allgather:
      return "allgather";
    case OpKind::Gather:
      return "gather";
    case OpKind::Scatter:
      return "scatter";
    case OpKind::ReduceScatter:
      return "reduce_scatter";
    case OpKind::AllToAll:
      return "alltoall";
    case OpKind::Barrier:
      return "barrier";
  }
  return "unknown op";
}

Communicator::Communicator(
    SharedSegment segment,
    SegmentLayout layout,
    int rank,
    std::chrono::milliseconds timeout)
    : segment_(std::move(segment)),
      layout_(layout),
      rank_(rank),
      timeout_ms_(timeout.count()),
      controls_(reinterpret_cast<RankControl*>(segment_.data() + layout_.controls_offset())),
      spin_for_(spin_budget(layout_.world)) {
  phase_ = mine().progress.load(std::memory_order_acquire);
  mine().pid = static_cast<int32_t>(::getpid());
  mine().pid_namespace = torchpar::pid_namespace();
}

void Communicator::start_op(OpDescriptor& descriptor, uint64_t stream_bytes) {
  descriptor.sequence = ++sequence_;
  descriptor.stream_bytes = stream_bytes;
  current_ = descriptor;
  TORCH_CHECK(failure_.empty(), describe(), ": the group is unusable since an earlier op failed (", failure_,
              "); create a new process group");
  controls_[rank_].descriptors[descriptor.sequence % 2] = descriptor;
  deadline_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_.load());
}

char* Communicator::slot(int rank) const {
  return slot(round_, rank);
}

char* Communicator::slot(uint64_t round, int rank) const {
  return segment_.data() + layout_.slot_offset(round, rank);
}

std::string Communicator::describe() const {
  return std::string("shm backend: ") + op_name(static_cast<OpKind>(current_.op)) + " #" +
      std::to_string(current_.sequence) + " on rank " + std::to_string(rank_);
}

void Communicator::meet() {
  advance(mine());
  ++phase_;
  wait_for_all(controls_, world(), phase_, deadline_, spin_for_, [this] { return describe(); });
}

template <typename Rounds>
void Communicator::run(Rounds&& rounds) {
  mismatch_ = false;
  try {
    rounds();
  } catch (const std::exception& e) {
    if (!mismatch_) {
      failure_ = message_of(e);
    }
    throw;
  }
}

void Communicator::publish(const Pieces& stream, uint64_t offset, uint64_t length, uint64_t keep_from,
                           uint64_t keep_to) {
  keep_from = std::min(keep_from, length);
  keep_to = std::clamp(keep_to, keep_from, length);
  stream.copy_out(offset, keep_from, slot(rank_));
  stream.copy_out(offset + keep_to, length - keep_to, slot(rank_) + keep_to);
  meet();
}

uint64_t Communicator::check_descriptors() {
  const auto parity = current_.sequence % 2;
  uint64_t longest = 0;
  std::vector<int> differing;
  for (int rank = 0; rank < world(); ++rank) {
    const OpDescriptor& theirs = controls_[rank].descriptors[parity];
    if (!same_call(theirs, current_)) {
      differing.push_back(rank);
    }
    longest = std::max(longest, theirs.stream_bytes);
  }
  if (!differing.empty()) {
    ++round_; // the round is over on every rank: the group stays usable
    mismatch_ = true;
    std::ostringstream text;
    text << describe() << ": the ranks called different collectives; this rank: " << describe_descriptor(current_);
    for (int rank : differing) {
      const OpDescriptor& theirs = controls_[rank].descriptors[parity];
      text << "; rank " << rank << ": " << describe_descriptor(theirs) << " (op #" << theirs.sequence << ")";
    }
    C10_THROW_ERROR(DistBackendError, text.str());
  }
  return longest;
}

void Communicator::exchange(
    OpDescriptor descriptor,
    const char* stream,
    uint64_t stream_bytes,
    const std::vector<Want>& wants) {
  start_op(descriptor, stream_bytes);
  const Pieces pieces(const_cast<char*>(stream), stream_bytes);  // only read
  run([&] {
    const uint64_t chunk = layout_.chunk_bytes;
    uint64_t rounds = 1;
    for (uint64_t k = 0; k < rounds; ++k) {
      const uint64_t begin = k * chunk;
      const uint64_t end = begin + chunk;
      publish(pieces, std::min(begin, stream_bytes), stream_bytes > begin ? std::min(chunk, stream_bytes - begin) : 0);
      if (k == 0) {
        rounds = std::max<uint64_t>(1, ceil_div(check_descriptors(), chunk));
      }
      for (const Want& want : wants) {
        const uint64_t from = std::max(begin, want.offset);
        const uint64_t to = std::min(end, want.offset + want.length);
        if (from < to) {
          std::memcpy(want.destination + (from - want.offset), slot(want.source) + (from - begin), to - from);
        }
      }
      ++round_;
    }
  });
}

void Communicator::reduce(
    OpDescriptor descriptor,
    const at::Tensor& input,
    const at::Tensor& output,
    ReduceMode mode,
    c10d::ReduceOp::RedOpType op) {
  const auto bytes = [](const at::Tensor& tensor) { return static_cast<uint64_t>(tensor.nbytes()); };
  reduce(descriptor, Pieces(const_cast<char*>(static_cast<const char*>(input.const_data_ptr())), bytes(input)),
         Pieces(static_cast<char*>(output.data_ptr()), bytes(output)), input.scalar_type(), mode, op);
}

void Communicator::reduce(
    OpDescriptor descriptor,
    const Pieces& input,
    const Pieces& output,
    c10::ScalarType dtype,
    ReduceMode mode,
    c10d::ReduceOp::RedOpType op) {
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t numel = static_cast<int64_t>(input.bytes()) / element;
  start_op(descriptor, input.bytes());
  run([&] {
    const int64_t per_chunk = static_cast<int64_t>(layout_.chunk_bytes) / element;
    const uint64_t rounds = std::max<uint64_t>(1, ceil_div(static_cast<uint64_t>(numel), per_chunk));
    const bool one_shot = mode == ReduceMode::All && rounds == 1 && descriptor.stream_bytes <= kOneShotBytes;
    const int64_t block = mode == ReduceMode::Scatter ? numel / world() : 0;
    std::vector<const void*> sources(world());
    // Reduces elements [from, to) of the chunk that starts at element `begin` into the output (element
    // i at i - output_offset) and, unless null, into `shared` (for element `from`): this rank's
    // elements straight from its input where it kept them out of its slot, the others' from their
    // slots. One call of the kernel per stretch that no piece boundary interrupts.
    auto reduce_range = [&](int64_t begin, int64_t from, int64_t to, bool own_from_input, char* shared,
                            int64_t output_offset) {
      const uint64_t last = static_cast<uint64_t>(to * element);
      for (uint64_t at = static_cast<uint64_t>(from * element); at < last;) {
        const uint64_t output_at = at - static_cast<uint64_t>(output_offset * element);
        uint64_t length = std::min(last - at, output.contiguous_from(output_at));
        if (own_from_input) {
          length = std::min(length, input.contiguous_from(at));
        }
        const uint64_t within_chunk = at - static_cast<uint64_t>(begin * element);
        for (int rank = 0; rank < world(); ++rank) {
          sources[rank] = slot(rank) + within_chunk;
        }
        if (own_from_input) {
          sources[rank_] = input.at(at);
        }
        reduce_slices(output.at(output_at), shared ? shared + (at - from * element) : nullptr, sources,
                      static_cast<int64_t>(length) / element, dtype, op);
        at += length;
      }
    };
    const int64_t align = std::max<int64_t>(1, kPartitionAlignBytes / element);

    // The partition of chunk k each rank reduces (All: then copied out to every rank).
    auto part_range = [&](uint64_t k, int rank) {
      const int64_t begin = static_cast<int64_t>(k) * per_chunk;
      const int64_t end = std::min(numel, begin + per_chunk);
      const int64_t part = (ceil_div(static_cast<uint64_t>(end - begin), world()) + align - 1) / align * align;
      const int64_t from = std::min(end, begin + rank * part);
      return std::make_pair(from, std::min(end, from + part));
    };
    // Every rank copies the partitions the others reduced of chunk k, which `round` held, from their slots.
    auto copy_partitions = [&](uint64_t k, uint64_t round) {
      const int64_t begin = static_cast<int64_t>(k) * per_chunk;
      for (int rank = 0; rank < world(); ++rank) {
        const auto [theirs_from, theirs_to] = part_range(k, rank);
        if (rank != rank_ && theirs_from < theirs_to) {
          output.copy_in(theirs_from * element, (theirs_to - theirs_from) * element,
                         slot(round, rank) + (theirs_from - begin) * element);
        }
      }
    };

    for (uint64_t k = 0; k < rounds; ++k) {
      const int64_t begin = static_cast<int64_t>(k) * per_chunk;
      const int64_t end = std::min(numel, begin + per_chunk);
      // What only this rank reads of its own chunk stays out of its slot: the root's whole chunk, its
      // block of a scatter, its partition of a large all-reduce.
      std::pair<int64_t, int64_t> kept{begin, begin};
      if (mode == ReduceMode::Root && rank_ == descriptor.root) {
        kept = {begin, end};
      } else if (mode == ReduceMode::Scatter) {
        kept = {std::clamp(rank_ * block, begin, end), std::clamp((rank_ + 1) * block, begin, end)};
      } else if (mode == ReduceMode::All && !one_shot) {
        kept = part_range(k, rank_);
      }
      const auto bytes_from_begin = [&](int64_t index) { return static_cast<uint64_t>((index - begin) * element); };
      publish(input, begin * element, bytes_from_begin(end), bytes_from_begin(kept.first),
              bytes_from_begin(kept.second));
      if (k == 0) {
        check_descriptors();
      }
      const bool partitioned = mode == ReduceMode::All && !one_shot;
      if (partitioned && k > 0) {
        // Every rank published this round after reducing its partition of the previous one.
        copy_partitions(k - 1, round_ - 1);
      }
      // What only this rank reduces goes straight to the output (which may be the input itself) and,
      // for an all-reduce, in the same pass to the slot's unpublished part, where the others copy it from.
      const auto [from, to] = kept;
      if (from < to) {
        char* shared = mode == ReduceMode::All ? slot(rank_) + (from - begin) * element : nullptr;
        reduce_range(begin, from, to, true, shared, mode == ReduceMode::Scatter ? rank_ * block : 0);
      }
      if (one_shot) {
        reduce_range(begin, begin, end, false, nullptr, 0);
      } else if (partitioned && k + 1 == rounds) {
        // The last round has no next one to wait in.
        meet();
        copy_partitions(k, round_);
      }
      ++round_;
    }
  });
}

} // namespace torchpar::comm::shm
