#include <torchpar/ps/payload_ring.h>

#include <c10/util/Exception.h>

#include <unistd.h>

#include <atomic>
#include <cstring>

namespace torchpar::ps {
namespace {

constexpr uint64_t kAlignment = 64;  // payloads start on a cache line (and on every dtype's boundary)
constexpr size_t kHeaderBytes = 4096;

uint64_t round_up(uint64_t value, uint64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// At the start of the ring's memory. Each side writes one counter; they sit on their own cache lines so
// the two processes do not share one.
struct RingHeader {
  RegionStamp stamp;
  alignas(64) std::atomic<uint64_t> written;   // the sender's: data before it is complete
  alignas(64) std::atomic<uint64_t> consumed;  // the receiver's: space before it is free again
};
static_assert(sizeof(RingHeader) <= kHeaderBytes);
static_assert(std::atomic<uint64_t>::is_always_lock_free, "the ring's counters are shared between processes");

RingHeader* header_of(void* mapping) {
  return static_cast<RingHeader*>(mapping);
}

} // namespace

OutgoingRing::OutgoingRing(int64_t capacity) {
  TORCH_CHECK(capacity > 0, "torchpar.ps: a payload ring of ", capacity, " bytes");
  capacity_ = round_up(static_cast<uint64_t>(capacity), static_cast<uint64_t>(::getpagesize()));
  region_ = MemfdRegion::create(kHeaderBytes + capacity_, "torchpar-ps-payloads");
  token_ = random_region_token();
  auto* ring = new (region_.data()) RingHeader{};
  ring->stamp = RegionStamp{token_, capacity_};
}

char* OutgoingRing::data() const {
  return static_cast<char*>(region_.data()) + kHeaderBytes;
}

RegionOffer OutgoingRing::offer() const {
  return RegionOffer{memfd_host_key(), ::getpid(), region_.descriptor(), token_, static_cast<int64_t>(kHeaderBytes),
                     static_cast<int64_t>(capacity_)};
}

void OutgoingRing::close_descriptor() {
  region_.close_descriptor();
}

std::optional<uint64_t> OutgoingRing::write(const void* bytes, size_t size) {
  return write(size, [&](uint8_t* out) { std::memcpy(out, bytes, size); });
}

std::optional<uint64_t> OutgoingRing::write(size_t size, const std::function<void(uint8_t*)>& fill) {
  if (size > capacity_) return std::nullopt;
  // The unread payloads are those the receiver has not read past; the first of them is where the
  // occupied bytes start (a payload that went to the beginning left the end of the lap before it free).
  const uint64_t consumed = header_of(region_.data())->consumed.load(std::memory_order_acquire);
  while (!unread_.empty() && unread_.front().second <= consumed) unread_.pop_front();
  uint64_t position = round_up(written_, kAlignment);
  if (unread_.empty()) {
    // Nothing unread: start over at the beginning, so that the pages in use are those of the largest
    // payloads in flight, not the whole ring.
    position = round_up(written_, capacity_);
  } else {
    if (position % capacity_ + size > capacity_) position = round_up(position, capacity_);  // never split one
    if (position + size - unread_.front().first > capacity_) return std::nullopt;  // it would reach unread bytes
  }
  fill(reinterpret_cast<uint8_t*>(data() + position % capacity_));
  written_ = position + size;
  unread_.emplace_back(position, written_);
  header_of(region_.data())->written.store(written_, std::memory_order_release);
  return position;
}

std::unique_ptr<IncomingRing> IncomingRing::open(const RegionOffer& offer, std::string* why_not) {
  if (offer.header_bytes != static_cast<int64_t>(kHeaderBytes)) {
    *why_not = "the peer's ring has a header of " + std::to_string(offer.header_bytes) + " bytes, not " +
               std::to_string(kHeaderBytes);
    return nullptr;
  }
  auto region = open_offered_region(offer, "ring", why_not);
  if (!region) return nullptr;
  return std::unique_ptr<IncomingRing>(new IncomingRing(std::move(*region), static_cast<uint64_t>(offer.capacity)));
}

void IncomingRing::read(uint64_t position, size_t bytes, void* out) {
  std::memcpy(out, view(position, bytes), bytes);
  release(position, bytes);
}

const void* IncomingRing::view(uint64_t position, size_t bytes) const {
  const uint64_t written = header_of(region_.data())->written.load(std::memory_order_acquire);
  TORCH_CHECK(position >= consumed_ && bytes <= capacity_ && position % capacity_ + bytes <= capacity_ &&
                  position + bytes <= written,
              "torchpar.ps: a payload of ", bytes, " bytes at ring position ", position,
              " that the peer did not write (read up to ", consumed_, ", written up to ", written, ", capacity ",
              capacity_, ")");
  return static_cast<const char*>(region_.data()) + kHeaderBytes + position % capacity_;
}

void IncomingRing::release(uint64_t position, size_t bytes) {
  consumed_ = position + bytes;
  header_of(region_.data())->consumed.store(consumed_, std::memory_order_release);
}

} // namespace torchpar::ps
