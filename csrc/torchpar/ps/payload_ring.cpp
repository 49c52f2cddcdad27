#include <torchpar/ps/payload_ring.h>

#include <torchpar/common/host_id.h>

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

namespace torchpar::ps {
namespace {

constexpr uint64_t kAlignment = 64;  // payloads start on a cache line (and on every dtype's boundary)
constexpr size_t kHeaderBytes = 4096;

uint64_t round_up(uint64_t value, uint64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

std::string boot_id() {
  std::ifstream file("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(file, id);
  return id;
}

// At the start of the ring's memory. Each side writes one counter; they sit on their own cache lines so
// the two processes do not share one.
struct RingHeader {
  uint64_t token;
  uint64_t capacity;
  alignas(64) std::atomic<uint64_t> written;   // the sender's: data before it is complete
  alignas(64) std::atomic<uint64_t> consumed;  // the receiver's: space before it is free again
};
static_assert(sizeof(RingHeader) <= kHeaderBytes);
static_assert(std::atomic<uint64_t>::is_always_lock_free, "the ring's counters are shared between processes");

RingHeader* header_of(void* mapping) {
  return static_cast<RingHeader*>(mapping);
}

} // namespace

std::string ring_host() {
  return host_id() + "/" + boot_id();
}

OutgoingRing::OutgoingRing(int64_t capacity) {
  TORCH_CHECK(capacity > 0, "torchpar.ps: a payload ring of ", capacity, " bytes");
  capacity_ = round_up(static_cast<uint64_t>(capacity), static_cast<uint64_t>(::getpagesize()));
  mapping_bytes_ = kHeaderBytes + capacity_;
  fd_ = ::memfd_create("torchpar-ps-payloads", MFD_CLOEXEC);
  TORCH_CHECK(fd_ >= 0, "torchpar.ps: memfd_create failed: ", std::strerror(errno));
  if (::ftruncate(fd_, static_cast<off_t>(mapping_bytes_)) != 0) {
    const int error = errno;
    ::close(fd_);
    TORCH_CHECK(false, "torchpar.ps: a payload ring of ", mapping_bytes_, " bytes: ", std::strerror(error));
  }
  mapping_ = ::mmap(nullptr, mapping_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (mapping_ == MAP_FAILED) {
    const int error = errno;
    ::close(fd_);
    mapping_ = nullptr;
    TORCH_CHECK(false, "torchpar.ps: mapping a payload ring: ", std::strerror(error));
  }
  std::random_device random;
  token_ = (static_cast<uint64_t>(random()) << 32) ^ random() ^ static_cast<uint64_t>(::getpid());
  auto* ring = new (mapping_) RingHeader{};
  ring->token = token_;
  ring->capacity = capacity_;
}

OutgoingRing::~OutgoingRing() {
  close_descriptor();
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
}

char* OutgoingRing::data() const {
  return static_cast<char*>(mapping_) + kHeaderBytes;
}

RingOffer OutgoingRing::offer() const {
  return RingOffer{ring_host(), ::getpid(), fd_, token_, static_cast<int64_t>(capacity_)};
}

void OutgoingRing::close_descriptor() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::optional<uint64_t> OutgoingRing::write(const void* bytes, size_t size) {
  return write(size, [&](uint8_t* out) { std::memcpy(out, bytes, size); });
}

std::optional<uint64_t> OutgoingRing::write(size_t size, const std::function<void(uint8_t*)>& fill) {
  if (size > capacity_) return std::nullopt;
  // The unread payloads are those the receiver has not read past; the first of them is where the
  // occupied bytes start (a payload that went to the beginning left the end of the lap before it free).
  const uint64_t consumed = header_of(mapping_)->consumed.load(std::memory_order_acquire);
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
  header_of(mapping_)->written.store(written_, std::memory_order_release);
  return position;
}

std::unique_ptr<IncomingRing> IncomingRing::open(const RingOffer& offer, std::string* why_not) {
  if (offer.host != ring_host()) {
    *why_not = "the peer runs on another host (" + offer.host + ")";
    return nullptr;
  }
  const std::string path = "/proc/" + std::to_string(offer.pid) + "/fd/" + std::to_string(offer.fd);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    *why_not = "cannot open " + path + ": " + std::strerror(errno);
    return nullptr;
  }
  struct stat status {};
  const size_t bytes = kHeaderBytes + static_cast<size_t>(offer.capacity);
  if (::fstat(fd, &status) != 0 || offer.capacity <= 0 || static_cast<size_t>(status.st_size) != bytes) {
    ::close(fd);
    *why_not = path + " is not the peer's ring (its size differs)";
    return nullptr;
  }
  void* mapping = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the memory
  if (mapping == MAP_FAILED) {
    *why_not = "cannot map " + path + ": " + std::strerror(errno);
    return nullptr;
  }
  const auto* header = header_of(mapping);
  if (header->token != offer.token || header->capacity != static_cast<uint64_t>(offer.capacity)) {
    ::munmap(mapping, bytes);
    *why_not = path + " is not the peer's ring (another process with that id?)";
    return nullptr;
  }
  return std::unique_ptr<IncomingRing>(new IncomingRing(mapping, bytes, static_cast<uint64_t>(offer.capacity)));
}

IncomingRing::~IncomingRing() {
  ::munmap(mapping_, mapping_bytes_);
}

void IncomingRing::read(uint64_t position, size_t bytes, void* out) {
  std::memcpy(out, view(position, bytes), bytes);
  release(position, bytes);
}

const void* IncomingRing::view(uint64_t position, size_t bytes) const {
  const uint64_t written = header_of(mapping_)->written.load(std::memory_order_acquire);
  TORCH_CHECK(position >= consumed_ && bytes <= capacity_ && position % capacity_ + bytes <= capacity_ &&
                  position + bytes <= written,
              "torchpar.ps: a payload of ", bytes, " bytes at ring position ", position,
              " that the peer did not write (read up to ", consumed_, ", written up to ", written, ", capacity ",
              capacity_, ")");
  return static_cast<const char*>(mapping_) + kHeaderBytes + position % capacity_;
}

void IncomingRing::release(uint64_t position, size_t bytes) {
  consumed_ = position + bytes;
  header_of(mapping_)->consumed.store(consumed_, std::memory_order_release);
}

} // namespace torchpar::ps
