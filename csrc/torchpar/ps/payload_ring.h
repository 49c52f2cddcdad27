#pragma once
// Large payloads between two processes on one host, through shared memory instead of Gloo's socket:
// one ring per direction of a channel, owned by the sender. The sender copies a payload in and tells
// the receiver its position in the message's frame (which still goes through Gloo, so ordering,
// wake-ups and a dead peer's broken connection stay Gloo's); the receiver copies it out and hands the
// space back. The ring is an anonymous memfd the receiver maps through /proc/<pid>/fd/<fd>: no name
// in /dev/shm, so a process killed at any moment leaves nothing behind.
#include <torchpar/common/memfd_region.h>
#include <torchpar/ps/region_offer.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace torchpar::ps {

// The sending side: created by the sender, written only by it.
class OutgoingRing {
 public:
  // A ring of `capacity` data bytes (rounded up to whole pages); throws if memory cannot be had.
  explicit OutgoingRing(int64_t capacity);
  OutgoingRing(const OutgoingRing&) = delete;
  OutgoingRing& operator=(const OutgoingRing&) = delete;

  RegionOffer offer() const;
  // The peer has mapped the ring (or declined it): its descriptor is no longer needed.
  void close_descriptor();
  // Copies `bytes` into the ring and returns where they start, or nothing when the ring has not that
  // much free space now (the caller sends them another way: it never waits for the receiver).
  std::optional<uint64_t> write(const void* data, size_t bytes);
  // The same, for a payload `fill` writes into the ring's `bytes` at the pointer it is given.
  std::optional<uint64_t> write(size_t bytes, const std::function<void(uint8_t*)>& fill);
  int64_t capacity() const { return static_cast<int64_t>(capacity_); }

 private:
  char* data() const;

  MemfdRegion region_;
  uint64_t capacity_ = 0;
  uint64_t token_ = 0;
  uint64_t written_ = 0;  // position after the last payload written
  std::deque<std::pair<uint64_t, uint64_t>> unread_;  // payloads written and maybe not read: [start, end)
};

// The receiving side: the peer's ring, mapped.
class IncomingRing {
 public:
  // Maps the ring `offer` describes, or returns null with the reason in `why_not` (another host, a
  // /proc this process may not read, a token that does not match).
  static std::unique_ptr<IncomingRing> open(const RegionOffer& offer, std::string* why_not);
  IncomingRing(const IncomingRing&) = delete;
  IncomingRing& operator=(const IncomingRing&) = delete;

  // Copies the `bytes` the sender wrote at `position` into `out` and hands their space back. Payloads
  // are read in the order they were written; a position or size the sender cannot have written throws.
  void read(uint64_t position, size_t bytes, void* out);
  // The same bytes in place, valid until release(position, bytes) hands their space back.
  const void* view(uint64_t position, size_t bytes) const;
  void release(uint64_t position, size_t bytes);

 private:
  IncomingRing(MemfdRegion region, uint64_t capacity) : region_(std::move(region)), capacity_(capacity) {}
  MemfdRegion region_;
  uint64_t capacity_;
  uint64_t consumed_ = 0;  // position after the last payload read
};

} // namespace torchpar::ps
