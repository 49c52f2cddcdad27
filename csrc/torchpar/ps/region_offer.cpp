#include <torchpar/ps/region_offer.h>

#include <unistd.h>

#include <random>

namespace torchpar::ps {

uint64_t random_region_token() {
  std::random_device random;
  return (static_cast<uint64_t>(random()) << 32) ^ random() ^ static_cast<uint64_t>(::getpid());
}

void put_offer(WireWriter& writer, const RegionOffer& offer) {
  writer.put_string(offer.host);
  writer.put<int64_t>(offer.pid);
  writer.put<int64_t>(offer.fd);
  writer.put<uint64_t>(offer.token);
  writer.put<int64_t>(offer.header_bytes);
  writer.put<int64_t>(offer.capacity);
}

RegionOffer get_offer(WireReader& reader) {
  RegionOffer offer;
  offer.host = reader.get_string("region host");
  offer.pid = reader.get<int64_t>("region pid");
  offer.fd = reader.get<int64_t>("region descriptor");
  offer.token = reader.get<uint64_t>("region token");
  offer.header_bytes = reader.get<int64_t>("region header size");
  offer.capacity = reader.get<int64_t>("region capacity");
  return offer;
}

std::optional<MemfdRegion> open_offered_region(const RegionOffer& offer, const char* what, std::string* why_not) {
  if (offer.host != memfd_host_key()) {
    *why_not = "the peer runs on another host (" + offer.host + ")";
    return std::nullopt;
  }
  if (offer.capacity <= 0 || offer.header_bytes < static_cast<int64_t>(sizeof(RegionStamp))) {
    *why_not = std::string("the peer offers ") + what + " of " + std::to_string(offer.capacity) +
               " bytes after a header of " + std::to_string(offer.header_bytes);
    return std::nullopt;
  }
  auto region =
      MemfdRegion::open(offer.pid, offer.fd, static_cast<size_t>(offer.header_bytes + offer.capacity), why_not);
  if (!region) return std::nullopt;
  const auto* stamp = static_cast<const RegionStamp*>(region->data());
  if (stamp->token != offer.token || stamp->capacity != static_cast<uint64_t>(offer.capacity)) {
    *why_not = "/proc/" + std::to_string(offer.pid) + "/fd/" + std::to_string(offer.fd) + " is not the peer's " +
               what + " (another process with that id?)";
    return std::nullopt;
  }
  return region;
}

} // namespace torchpar::ps
