#include <torchpar/pipeline/same_host_rings.h>

#include <torchpar/common/control_collectives.h>
#include <torchpar/common/error_message.h>
#include <torchpar/common/process_state.h>
#include <torchpar/comm/group_timeout.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <set>
#include <thread>

namespace torchpar::pipeline {
namespace {

constexpr size_t kHeaderBytes = 4096;
constexpr uint64_t kRecordAlignment = 64;  // records start on a cache line; their data one line later
constexpr int64_t kWrapTag = INT64_MIN;    // the rest of this lap is empty: the next record is at the lap's start
// A waiting rank looks at its rings this often and sleeps in between, leaving the core to the ranks that
// compute (ranks may share cores).
constexpr std::chrono::microseconds kPollEvery{50};
constexpr std::chrono::milliseconds kLivenessEvery{50};

std::exception_ptr size_mismatch(int peer, size_t sent, size_t expected) {
  return std::make_exception_ptr(std::runtime_error(c10::str(
      "rank ", peer, " sent ", sent, " bytes for this message, the receive expected ", expected)));
}

// At the start of each ring's memory; the sender writes `head`, the receiver `tail`, each on its own line.
struct RingHeader {
  uint64_t token;
  uint64_t capacity;
  alignas(64) std::atomic<uint64_t> head;  // records before it are complete
  alignas(64) std::atomic<uint64_t> tail;  // space before it is free again
};
static_assert(sizeof(RingHeader) <= kHeaderBytes);
static_assert(std::atomic<uint64_t>::is_always_lock_free, "the rings' counters are shared between processes");

// A message goes as one record, or as fragments of at most a quarter of the ring each.
struct Record {
  int64_t tag;
  int64_t total;   // the message's bytes
  int64_t offset;  // of this fragment in the message
  int64_t bytes;   // of this fragment
};
static_assert(sizeof(Record) <= kRecordAlignment);

RingHeader& header_of(const MemfdRegion& region) {
  return *static_cast<RingHeader*>(region.data());
}
uint8_t* data_of(const MemfdRegion& region) {
  return static_cast<uint8_t*>(region.data()) + kHeaderBytes;
}
uint64_t round_up(uint64_t value, uint64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}
uint64_t record_bytes(uint64_t data_bytes) {
  return kRecordAlignment + round_up(data_bytes, kRecordAlignment);
}

} // namespace

RingWork::RingWork(SameHostRings* rings, at::Tensor tensor, int peer, int tag, bool sending)
    : c10d::Work(-1, sending ? c10d::OpType::SEND : c10d::OpType::RECV),
      rings_(rings), tensor_(std::move(tensor)), peer_(peer), tag_(tag), sending_(sending) {}

bool RingWork::isCompleted() {
  if (!done_) rings_->progress();
  return done_;
}

bool RingWork::wait(std::chrono::milliseconds /*timeout: the group's applies*/) {
  rings_->wait_for(*this);
  if (error_) std::rethrow_exception(error_);
  return true;
}

void RingWork::finish(std::exception_ptr error) {
  done_ = true;
  error_ = std::move(error);
}

int64_t SameHostRings::default_ring_bytes() {
  return ring_bytes_from_environment("TORCHPAR_PIPELINE_RING_BYTES", int64_t{16} << 20,
                                     "0 sends every pipeline message through the process group");
}

std::unique_ptr<SameHostRings> SameHostRings::connect(c10d::ProcessGroup& group, int64_t ring_bytes) {
  const int rank = group.getRank(), ranks = group.getSize();
  std::unique_ptr<SameHostRings> rings(new SameHostRings(rank, comm::group_timeout(group)));
  std::set<int> neighbours;
  if (ranks > 1) {
    neighbours = {(rank + 1) % ranks, (rank + ranks - 1) % ranks};
  }
  // Per rank: host, pid, whether it takes part, then for every rank the descriptor and token of its ring
  // to that rank (-1: none).
  const int64_t capacity = static_cast<int64_t>(round_up(static_cast<uint64_t>(std::max<int64_t>(ring_bytes, 0)),
                                                         static_cast<uint64_t>(::getpagesize())));
  std::vector<int64_t> offer(4 + 2 * static_cast<size_t>(ranks), -1);
  offer[0] = static_cast<int64_t>(std::hash<std::string>()(memfd_host_key()));
  offer[1] = ::getpid();
  offer[2] = ring_bytes > 0 ? 1 : 0;
  offer[3] = capacity;
  std::string why_not = ring_bytes > 0 ? "" : "TORCHPAR_PIPELINE_RING_BYTES=0";
  std::random_device random;
  for (int peer : neighbours) {
    if (ring_bytes <= 0) break;
    try {
      Outgoing out;
      out.region = MemfdRegion::create(kHeaderBytes + static_cast<size_t>(capacity), "torchpar-pipeline-ring");
      auto* header = new (out.region.data()) RingHeader{};
      header->token = (static_cast<uint64_t>(random()) << 32) ^ random();
      header->capacity = static_cast<uint64_t>(capacity);
      offer[4 + 2 * peer] = out.region.descriptor();
      offer[5 + 2 * peer] = static_cast<int64_t>(header->token);
      rings->outgoing_.emplace(peer, std::move(out));
    } catch (const std::exception& error) {
      offer[2] = 0;
      why_not = message_of(error);
    }
  }
  const auto offers = all_gather(group, at::tensor(offer, at::kLong), c10::Device(c10::kCPU));
  auto field = [&](int of, size_t index) { return offers[of].data_ptr<int64_t>()[index]; };
  bool usable = offer[2] == 1;
  for (int peer : neighbours) {
    if (!usable) break;
    if (field(peer, 0) != offer[0]) {
      rings->outgoing_.erase(peer);  // on another host: this link stays on the group
      continue;
    }
    if (field(peer, 2) != 1) {
      why_not = "rank " + std::to_string(peer) + " has none (TORCHPAR_PIPELINE_RING_BYTES=0 there, or it could not "
                "create one)";
      usable = false;
      break;
    }
    const int64_t fd = field(peer, 4 + 2 * rank), token = field(peer, 5 + 2 * rank), peer_capacity = field(peer, 3);
    auto region = MemfdRegion::open(field(peer, 1), fd, kHeaderBytes + static_cast<size_t>(peer_capacity), &why_not);
    if (!region || static_cast<int64_t>(header_of(*region).token) != token ||
        static_cast<int64_t>(header_of(*region).capacity) != peer_capacity) {
      if (region) why_not = "a ring that is not the peer's (another process with that id?)";
      usable = false;
      break;
    }
    Incoming in;
    in.region = std::move(*region);
    in.pid = field(peer, 1);
    rings->incoming_.emplace(peer, std::move(in));
  }
  // Every rank uses the rings or none does: a link's two ends must agree on its path.
  const auto unusable = all_reduce_sum(group, at::tensor({int64_t{usable ? 0 : 1}}, at::kLong), c10::Device(c10::kCPU));
  for (auto& [peer, out] : rings->outgoing_) out.region.close_descriptor();  // the peers mapped theirs
  if (unusable.item<int64_t>() > 0) {
    if (!usable && ring_bytes > 0) {
      LOG(WARNING) << "torchpar pipeline rank " << rank << ": messages go through the process group, not "
                   << "shared-memory rings: " << why_not;
    }
    return nullptr;
  }
  if (rings->outgoing_.empty() && rings->incoming_.empty()) return nullptr;
  return rings;
}

SameHostRings::~SameHostRings() = default;

bool SameHostRings::connects(int peer) const {
  return outgoing_.count(peer) > 0 && incoming_.count(peer) > 0;
}

bool SameHostRings::try_write(Outgoing& out, RingWork& send) {
  auto& header = header_of(out.region);
  const uint64_t capacity = header.capacity;
  const uint64_t largest_fragment = capacity / 4 - kRecordAlignment;
  const size_t total = send.tensor_.nbytes();
  uint8_t* data = data_of(out.region);
  do {
    const size_t fragment = std::min<size_t>(total - send.transferred_, largest_fragment);
    const uint64_t needed = record_bytes(fragment);
    const uint64_t tail = header.tail.load(std::memory_order_acquire);
    uint64_t start = out.written;
    const uint64_t at = start % capacity;
    if (tail == start && at >= capacity / 4) {
      // The ring is empty: back to its start, so that the pages in use stay near its first half, not the whole
      // ring. Until the reader passes the wrap record left at `at`, only the `at` bytes before it are free: from
      // less than a quarter in, a restart left room for one message or two, and a stage's later sends queued
      // until it next waited (GPipe, m = 8: a gradient held back 7 ms).
      start = round_up(start, capacity);
    } else {
      if (at + needed > capacity) start = round_up(start, capacity);  // a record never wraps
      if (start + needed - tail > capacity) return false;
    }
    if (start != out.written) {
      const Record wrap{kWrapTag, 0, 0, 0};
      std::memcpy(data + out.written % capacity, &wrap, sizeof(wrap));
    }
    const Record record{send.tag_, static_cast<int64_t>(total), static_cast<int64_t>(send.transferred_),
                        static_cast<int64_t>(fragment)};
    std::memcpy(data + start % capacity, &record, sizeof(record));
    if (fragment > 0) {
      std::memcpy(data + start % capacity + kRecordAlignment,
                  static_cast<const uint8_t*>(send.tensor_.const_data_ptr()) + send.transferred_, fragment);
    }
    send.transferred_ += fragment;
    out.written = start + needed;
    header.head.store(out.written, std::memory_order_release);
  } while (send.transferred_ < total);
  return true;
}

void SameHostRings::drain(int peer, Incoming& in) {
  auto& header = header_of(in.region);
  const uint64_t capacity = header.capacity;
  const uint64_t head = header.head.load(std::memory_order_acquire);
  uint64_t tail = header.tail.load(std::memory_order_relaxed);  // only this end writes it
  const uint8_t* data = data_of(in.region);
  while (tail < head) {
    Record record{};
    std::memcpy(&record, data + tail % capacity, sizeof(record));
    if (record.tag == kWrapTag) {
      tail = round_up(tail + 1, capacity);
      header.tail.store(tail, std::memory_order_release);
      continue;
    }
    const uint64_t needed = record_bytes(static_cast<uint64_t>(std::max<int64_t>(record.bytes, 0)));
    TORCH_CHECK(record.bytes >= 0 && record.offset >= 0 && record.offset + record.bytes <= record.total &&
                    tail % capacity + needed <= capacity && tail + needed <= head,
                "pipeline: a corrupt record in the ring from rank ", peer, " (", record.bytes, " bytes of ",
                record.total, " at ", record.offset, ", ring position ", tail, ")");
    const uint8_t* payload = data + tail % capacity + kRecordAlignment;
    const int tag = static_cast<int>(record.tag);
    const bool last = record.offset + record.bytes == record.total;
    auto posted = in.posted.find(tag);
    if (posted != in.posted.end()) {
      RingWork& work = *posted->second;
      const size_t expected = work.tensor_.nbytes();
      if (expected != static_cast<size_t>(record.total)) {
        if (!work.done_) work.finish(size_mismatch(peer, static_cast<size_t>(record.total), expected));
      } else if (record.bytes > 0) {
        std::memcpy(static_cast<uint8_t*>(work.tensor_.data_ptr()) + record.offset, payload,
                    static_cast<size_t>(record.bytes));
      }
      work.transferred_ += static_cast<size_t>(record.bytes);
      if (last) {
        if (!work.done_) work.finish();
        in.posted.erase(posted);
      }
    } else {
      auto& aside = in.set_aside[tag];
      if (record.offset == 0) {
        TORCH_CHECK(!aside.message.defined(), "pipeline: rank ", peer, " sent two messages with tag ", tag,
                    " before this rank received the first");
        aside.message = at::empty({record.total}, at::kByte);
      }
      TORCH_CHECK(aside.message.defined() && aside.message.nbytes() == static_cast<size_t>(record.total) &&
                      aside.received == static_cast<size_t>(record.offset),
                  "pipeline: rank ", peer, " sent a fragment of tag ", tag, " out of order");
      if (record.bytes > 0) {
        std::memcpy(static_cast<uint8_t*>(aside.message.data_ptr()) + record.offset, payload,
                    static_cast<size_t>(record.bytes));
      }
      aside.received += static_cast<size_t>(record.bytes);
    }
    tail += needed;
    header.tail.store(tail, std::memory_order_release);
  }
}

void SameHostRings::progress() {
  for (auto& [peer, out] : outgoing_) {
    while (!out.queued.empty() && try_write(out, *out.queued.front())) {
      out.queued.front()->finish();
      out.queued.pop_front();
    }
  }
  for (auto& [peer, in] : incoming_) drain(peer, in);
}

c10::intrusive_ptr<c10d::Work> SameHostRings::send(const at::Tensor& tensor, int peer, int tag) {
  auto work = c10::make_intrusive<RingWork>(this, tensor.contiguous(), peer, tag, true);
  auto& out = outgoing_.at(peer);
  if (out.queued.empty() && try_write(out, *work)) {
    work->finish();
  } else {
    out.queued.push_back(work);
  }
  return work;
}

c10::intrusive_ptr<c10d::Work> SameHostRings::recv(const at::Tensor& buffer, int peer, int tag) {
  TORCH_INTERNAL_ASSERT(buffer.is_contiguous());
  auto work = c10::make_intrusive<RingWork>(this, buffer, peer, tag, false);
  auto& in = incoming_.at(peer);
  auto aside = in.set_aside.find(tag);
  if (aside != in.set_aside.end()) {
    // What arrived before this receive: all of the message, or its first fragments.
    const auto message = aside->second.message;
    const size_t received = aside->second.received;
    in.set_aside.erase(aside);
    if (message.nbytes() != buffer.nbytes()) {
      work->finish(size_mismatch(peer, message.nbytes(), buffer.nbytes()));
      return work;  // its remaining fragments, if any, are set aside and dropped with discard_pending()
    }
    if (received > 0) std::memcpy(buffer.data_ptr(), message.const_data_ptr(), received);
    work->transferred_ = received;
    if (received == buffer.nbytes()) {
      work->finish();
      return work;
    }
  }
  TORCH_CHECK(in.posted.emplace(tag, work).second, "pipeline: a second receive posted for tag ", tag,
              " from rank ", peer);
  drain(peer, in);
  return work;
}

void SameHostRings::wait_for(RingWork& work) {
  const auto started = std::chrono::steady_clock::now();
  auto next_liveness_check = started + kLivenessEvery;
  while (!work.done_) {
    progress();
    if (work.done_) break;
    const auto now = std::chrono::steady_clock::now();
    const auto waited = now - started;
    const char* what = work.sending_ ? "for room in the ring to" : "for a message from";
    TORCH_CHECK(waited < timeout_, "timed out after ", timeout_.count(), " ms waiting ", what, " rank ", work.peer_);
    if (now >= next_liveness_check) {
      next_liveness_check = now + kLivenessEvery;
      auto in = incoming_.find(work.peer_);
      TORCH_CHECK(in == incoming_.end() || process_state(static_cast<int>(in->second.pid)) != ProcessState::Exited, "waiting ", what, " rank ", work.peer_,
                  ": its process (", in->second.pid, ") has exited");
    }
    std::this_thread::sleep_for(kPollEvery);
  }
}

void SameHostRings::discard_pending() {
  for (auto& [peer, out] : outgoing_) out.queued.clear();
  for (auto& [peer, in] : incoming_) {
    in.posted.clear();
    in.set_aside.clear();
  }
}

} // namespace torchpar::pipeline
