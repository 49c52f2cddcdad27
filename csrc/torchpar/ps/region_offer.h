#pragma once
// What a process tells a peer on its host so that the peer can map one of its memfd regions (a
// payload ring, a table's values): where the region is, and a token the region's first bytes must
// hold, so that another process that got the same pid and descriptor number is refused.
#include <torchpar/common/memfd_region.h>
#include <torchpar/ps/wire_format.h>

#include <cstdint>
#include <optional>
#include <string>

namespace torchpar::ps {

struct RegionOffer {
  std::string host;          // memfd_host_key()
  int64_t pid = 0;
  int64_t fd = 0;
  uint64_t token = 0;
  int64_t header_bytes = 0;  // the region: a header that starts with the token and `capacity`,
  int64_t capacity = 0;      // then `capacity` data bytes
};

// The first bytes of every offered region.
struct RegionStamp {
  uint64_t token;
  uint64_t capacity;
};

uint64_t random_region_token();

void put_offer(WireWriter& writer, const RegionOffer& offer);
RegionOffer get_offer(WireReader& reader);

// Maps the region `offer` describes, or returns nothing with the reason in `why_not` (another host, a
// /proc this process may not read, a stamp that does not match). `what` names it in the reason.
std::optional<MemfdRegion> open_offered_region(const RegionOffer& offer, const char* what, std::string* why_not);

} // namespace torchpar::ps
