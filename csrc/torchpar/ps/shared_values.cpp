#include <torchpar/ps/shared_values.h>

#include <torchpar/common/futex.h>
#include <torchpar/common/process_state.h>

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace torchpar::ps {
namespace {

constexpr int64_t kCacheLine = 64;
// Between two looks at a reader that has not handed the values back: is its process still there?
constexpr std::chrono::milliseconds kCheckEvery{10};
// How long a reader whose process is stopped (SIGSTOP, a debugger) keeps its lending: every other worker's
// request waits behind the server meanwhile, and a stopped process copies nothing.
constexpr std::chrono::milliseconds kStoppedGrace{500};

struct ValuesHeader {
  RegionStamp stamp;
  uint32_t slots;
  alignas(kCacheLine) std::atomic<uint32_t> returns; // bumped by every hand-back; the server sleeps on it
};

// One per worker, each on its own cache line: only that worker and the server touch it.
struct alignas(kCacheLine) ReaderSlot {
  std::atomic<uint64_t> generation; // of the lending held; 0: none
  int64_t pid;                      // the worker's, written when it maps the values
  uint64_t pid_namespace;
};

constexpr int64_t kSlotsAt = (sizeof(ValuesHeader) + kCacheLine - 1) / kCacheLine * kCacheLine;
static_assert(std::atomic<uint64_t>::is_always_lock_free, "the slots are shared between processes");

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

ValuesHeader* header_of(const MemfdRegion& region) {
  return static_cast<ValuesHeader*>(region.data());
}

ReaderSlot& slot_of(const MemfdRegion& region, int worker) {
  return reinterpret_cast<ReaderSlot*>(static_cast<char*>(region.data()) + kSlotsAt)[worker];
}

} // namespace

SharedValues::SharedValues(int64_t numel, c10::ScalarType dtype, int num_workers, std::chrono::milliseconds timeout,
                           OnRevoked on_revoked)
    : num_workers_(num_workers),
      token_(random_region_token()),
      header_bytes_(round_up(kSlotsAt + num_workers * static_cast<int64_t>(sizeof(ReaderSlot)), ::getpagesize())),
      capacity_(round_up(std::max<int64_t>(numel * static_cast<int64_t>(c10::elementSize(dtype)), 1),
                         ::getpagesize())),
      timeout_(timeout),
      on_revoked_(std::move(on_revoked)) {
  TORCH_CHECK(num_workers > 0, "torchpar.ps: shared values for ", num_workers, " workers");
  region_ = MemfdRegion::create(static_cast<size_t>(header_bytes_ + capacity_), "torchpar-ps-values");
  auto* header = new (region_.data()) ValuesHeader{};
  header->stamp = RegionStamp{token_, static_cast<uint64_t>(capacity_)};
  header->slots = static_cast<uint32_t>(num_workers);
  for (int w = 0; w < num_workers; ++w) {
    new (&slot_of(region_, w)) ReaderSlot{};
  }
  values_ = at::from_blob(static_cast<char*>(region_.data()) + header_bytes_, {numel},
                          at::TensorOptions().dtype(dtype));
}

RegionOffer SharedValues::offer() const {
  return RegionOffer{memfd_host_key(), ::getpid(), region_.descriptor(), token_, header_bytes_, capacity_};
}

uint64_t SharedValues::lend(int worker) {
  TORCH_CHECK(worker >= 0 && worker < num_workers_, "torchpar.ps: no reader slot for worker ", worker);
  auto& slot = slot_of(region_, worker);
  if (slot.generation.load(std::memory_order_acquire) != 0) return 0;
  const uint64_t generation = ++generation_;
  // Release: the values as they are now are what the reader sees when it finds this generation.
  slot.generation.store(generation, std::memory_order_release);
  return generation;
}

void SharedValues::revoke(int worker) {
  auto& slot = slot_of(region_, worker);
  uint64_t held = slot.generation.load(std::memory_order_acquire);
  if (held != 0) slot.generation.compare_exchange_strong(held, 0, std::memory_order_acq_rel);
}

void SharedValues::wait_until_returned() {
  auto& returns = header_of(region_)->returns;
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (int w = 0; w < num_workers_; ++w) {
    auto& slot = slot_of(region_, w);
    if (slot.generation.load(std::memory_order_acquire) == 0) continue;
    constexpr auto kNotStopped = std::chrono::steady_clock::time_point::max();
    auto stopped_since = kNotStopped;
    while (true) {
      // Read before the slot: a hand-back between the two changes it, and the sleep returns at once.
      const uint32_t seen = returns.load(std::memory_order_seq_cst);
      uint64_t held = slot.generation.load(std::memory_order_seq_cst);
      if (held == 0) break;
      const auto now = std::chrono::steady_clock::now();
      const auto state = slot.pid != 0 && slot.pid_namespace == pid_namespace()
                             ? process_state(static_cast<int>(slot.pid))
                             : ProcessState::Running;
      if (state != ProcessState::Stopped) {
        stopped_since = kNotStopped;
      } else if (stopped_since == kNotStopped) {
        stopped_since = now;
      }
      std::string why;
      if (state == ProcessState::Exited) {
        why = "its process exited while it read them";
      } else if (state == ProcessState::Stopped && now - stopped_since >= kStoppedGrace) {
        why = "its process was stopped (SIGSTOP or a debugger) for " + std::to_string(kStoppedGrace.count()) +
              " ms while it held them";
      } else if (now >= deadline) {
        why = "it did not finish reading them within the timeout (" + std::to_string(timeout_.count()) + " ms)";
      }
      if (!why.empty()) {
        // Acquire: had its copy just finished, it is over before the values change.
        if (slot.generation.compare_exchange_strong(held, 0, std::memory_order_acq_rel)) on_revoked_(w, why);
        continue;
      }
      futex_wait(returns, seen, std::min<std::chrono::nanoseconds>(kCheckEvery, deadline - now));
    }
  }
}

std::unique_ptr<MappedValues> MappedValues::open(const RegionOffer& offer, int worker, std::string* why_not) {
  auto region = open_offered_region(offer, "table values", why_not);
  if (!region) return nullptr;
  const auto slots = header_of(*region)->slots;
  if (offer.header_bytes < kSlotsAt + static_cast<int64_t>(slots * sizeof(ReaderSlot)) || worker < 0 ||
      static_cast<uint32_t>(worker) >= slots) {
    *why_not = "the server's values have " + std::to_string(slots) + " reader slots in a header of " +
               std::to_string(offer.header_bytes) + " bytes; this is worker " + std::to_string(worker);
    return nullptr;
  }
  auto& slot = slot_of(*region, worker);
  slot.pid = ::getpid();
  slot.pid_namespace = pid_namespace();
  return std::unique_ptr<MappedValues>(
      new MappedValues(std::move(*region), worker, offer.header_bytes, offer.capacity));
}

bool MappedValues::hand_back(uint64_t generation) {
  auto& slot = slot_of(region_, worker_);
  // Release: the copy is over before the server, seeing 0, changes the values.
  const bool returned = slot.generation.compare_exchange_strong(generation, 0, std::memory_order_acq_rel);
  auto& returns = header_of(region_)->returns;
  returns.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(returns);
  return returned;
}

void MappedValues::hand_back_any() {
  const uint64_t held = slot_of(region_, worker_).generation.load(std::memory_order_acquire);
  if (held != 0) hand_back(held);
}

void MappedValues::read(uint64_t generation, size_t bytes, void* out) {
  TORCH_CHECK(generation != 0 && static_cast<int64_t>(bytes) <= capacity_, "torchpar.ps: a reply lends ", bytes,
              " bytes of values as generation ", generation, "; the server's table holds ", capacity_);
  const uint64_t held = slot_of(region_, worker_).generation.load(std::memory_order_acquire);
  TORCH_CHECK(held == generation, "torchpar.ps: the server took back the values it lent for this read before they ",
              "were copied (this worker's slot holds lending ", held, ", the reply names ", generation, ")");
  std::memcpy(out, static_cast<const char*>(region_.data()) + header_bytes_, bytes);
  TORCH_CHECK(hand_back(generation), "torchpar.ps: the server took back the values it lent for this read while ",
              "they were copied (this worker held them longer than the timeout): the read is not consistent, so it ",
              "fails");
}

} // namespace torchpar::ps
