#pragma once
// A dense shard's values in memory that the workers on the server's host map, so that a read is
// answered without copying the values into the reply: the server lends them to the reading worker,
// which copies them straight out of the table, then hands them back. The server changes values only
// once every reader has handed them back — or died (its lending is revoked at once), or was stopped
// (SIGSTOP, a debugger) for half a second, or held them past the timeout (revoked then, and that read
// fails rather than return values changed under it).
//
// Each worker has a slot in the region's header: the generation of the lending it holds (0: none). A
// lending is a fresh generation stored there; the worker hands it back by swapping it for 0, which it
// can only do while the server has not revoked it.
#include <torchpar/common/memfd_region.h>
#include <torchpar/ps/region_offer.h>

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

namespace torchpar::ps {

// The server's side: owns the values.
class SharedValues {
 public:
  using OnRevoked = std::function<void(int worker, const std::string& why)>;

  // Room for `numel` values of `dtype` (zeroed) and `num_workers` readers; throws if the memory cannot
  // be had.
  SharedValues(int64_t numel, c10::ScalarType dtype, int num_workers, std::chrono::milliseconds timeout,
               OnRevoked on_revoked);
  SharedValues(const SharedValues&) = delete;
  SharedValues& operator=(const SharedValues&) = delete;

  RegionOffer offer() const;
  // A view of the region: whoever keeps it must keep this object.
  const at::Tensor& values() const { return values_; }

  // Lends the values to `worker` and returns the lending's generation for the reply; 0 when the
  // worker still holds an earlier lending (the caller then answers with a copy).
  uint64_t lend(int worker);
  // Returns once no worker holds the values (revoking as the header says); `timeout` counts from the
  // call, for all readers together.
  void wait_until_returned();
  // Takes back the lending `worker` holds, if any (a reply that failed after lending, a dropped worker).
  void revoke(int worker);

 private:
  MemfdRegion region_;
  int num_workers_;
  uint64_t token_;
  int64_t header_bytes_;
  int64_t capacity_;
  std::chrono::milliseconds timeout_;
  OnRevoked on_revoked_;
  at::Tensor values_;
  uint64_t generation_ = 0;
};

// A worker's side: the server's values, mapped.
class MappedValues {
 public:
  // Maps what `offer` describes and claims slot `worker` (this process's pid goes there), or returns
  // null with the reason in `why_not`.
  static std::unique_ptr<MappedValues> open(const RegionOffer& offer, int worker, std::string* why_not);
  MappedValues(const MappedValues&) = delete;
  MappedValues& operator=(const MappedValues&) = delete;

  // Copies the first `bytes` of the values lent as `generation` into `out` and hands them back. Throws
  // when the lending is not this worker's or was revoked before the copy was complete.
  void read(uint64_t generation, size_t bytes, void* out);
  // Swaps lending `generation` for 0 in this worker's slot and wakes the server; false when it was
  // revoked. Also called unread, by a reply that failed before reaching every value it lends.
  bool hand_back(uint64_t generation);
  // Hands back whatever lending this worker holds, unread: for a reply that arrived after its request
  // expired, whose lendings are not known.
  void hand_back_any();

 private:
  MappedValues(MemfdRegion region, int worker, int64_t header_bytes, int64_t capacity)
      : region_(std::move(region)), worker_(worker), header_bytes_(header_bytes), capacity_(capacity) {}

  MemfdRegion region_;
  int worker_;
  int64_t header_bytes_;
  int64_t capacity_;
};

} // namespace torchpar::ps
