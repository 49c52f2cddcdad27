// ps/payload_ring: the same-host ring a channel's large payloads take, both ends in this process
// (the receiving end maps the ring through /proc/self's descriptor, as a peer on the host would).
#include "catch_with_torch.h"

#include <torchpar/ps/payload_ring.h>

#include <numeric>
#include <vector>

namespace ps = torchpar::ps;
using Catch::Matchers::Contains;

namespace {

std::vector<uint8_t> pattern(size_t bytes, int seed) {
  std::vector<uint8_t> data(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>((i * 7 + static_cast<size_t>(seed)) % 253);
  return data;
}

std::unique_ptr<ps::IncomingRing> open_or_fail(const ps::RegionOffer& offer) {
  std::string why_not;
  auto ring = ps::IncomingRing::open(offer, &why_not);
  INFO(why_not);
  REQUIRE(ring);
  return ring;
}

} // namespace

TEST_CASE("ps payload ring: payloads come out as they went in, and one sent into an empty ring starts at its beginning") {
  ps::OutgoingRing outgoing(4096);
  REQUIRE(outgoing.capacity() == 4096);
  auto incoming = open_or_fail(outgoing.offer());
  for (int round = 0; round < 20; ++round) {
    const size_t bytes = 1 + static_cast<size_t>(round * 131) % 3000;
    const auto sent = pattern(bytes, round);
    const auto position = outgoing.write(sent.data(), bytes);
    REQUIRE(position);
    CHECK(*position % 4096 == 0);  // the pages in use stay those of the largest payload
    std::vector<uint8_t> received(bytes);
    incoming->read(*position, bytes, received.data());
    CHECK(received == sent);
  }
}

TEST_CASE("ps payload ring: payloads in flight together go one after another, across the end, never split") {
  ps::OutgoingRing outgoing(4096);
  auto incoming = open_or_fail(outgoing.offer());
  // Two in flight at a time, of sizes that do not divide the capacity, so they reach the end and
  // start over at the beginning while the one before is still unread.
  std::vector<std::pair<uint64_t, std::vector<uint8_t>>> unread;
  for (int round = 0; round < 60; ++round) {
    const size_t bytes = 1 + static_cast<size_t>(round * 131) % 1000;
    auto sent = pattern(bytes, round);
    const auto position = outgoing.write(sent.data(), bytes);
    REQUIRE(position);
    CHECK(*position % 64 == 0);
    CHECK(*position % 4096 + bytes <= 4096);
    unread.emplace_back(*position, std::move(sent));
    if (unread.size() == 2) {
      const auto [at, expected] = unread.front();
      std::vector<uint8_t> received(expected.size());
      incoming->read(at, expected.size(), received.data());
      CHECK(received == expected);
      unread.erase(unread.begin());
    }
  }
}

TEST_CASE("ps payload ring: a full ring refuses a payload until the receiver has read what fills it") {
  ps::OutgoingRing outgoing(4096);
  auto incoming = open_or_fail(outgoing.offer());
  const auto first = pattern(2000, 1), second = pattern(1500, 2), third = pattern(1000, 3);
  const auto at_first = outgoing.write(first.data(), first.size());
  const auto at_second = outgoing.write(second.data(), second.size());
  REQUIRE(at_first);
  REQUIRE(at_second);
  CHECK_FALSE(outgoing.write(third.data(), third.size()));  // 3520 bytes in use: no 1000 more
  CHECK_FALSE(outgoing.write(pattern(5000, 4).data(), 5000));  // larger than the ring: never
  std::vector<uint8_t> received(first.size());
  incoming->read(*at_first, first.size(), received.data());
  CHECK(received == first);
  const auto at_third = outgoing.write(third.data(), third.size());  // wraps into the space read
  REQUIRE(at_third);
  CHECK(*at_third % 4096 == 0);
  received.resize(second.size());
  incoming->read(*at_second, second.size(), received.data());
  CHECK(received == second);
  received.resize(third.size());
  incoming->read(*at_third, third.size(), received.data());
  CHECK(received == third);
}

TEST_CASE("ps payload ring: once a payload went back to the beginning, the end of the lap before is free") {
  ps::OutgoingRing outgoing(4096);
  auto incoming = open_or_fail(outgoing.offer());
  const auto a = pattern(1000, 1), b = pattern(2000, 2), c = pattern(1500, 3), d = pattern(600, 4);
  std::vector<uint8_t> received(2000);
  const auto at_a = outgoing.write(a.data(), a.size());
  REQUIRE(at_a);
  incoming->read(*at_a, a.size(), received.data());
  const auto at_b = outgoing.write(b.data(), b.size());  // the ring is empty: b starts the next lap
  REQUIRE(at_b);
  CHECK(*at_b == 4096);
  const auto at_c = outgoing.write(c.data(), c.size());  // after b, though the receiver read only up to a
  REQUIRE(at_c);
  CHECK(*at_c % 4096 == 2048);
  CHECK_FALSE(outgoing.write(d.data(), d.size()));  // past the end, the beginning still holds b
  incoming->read(*at_b, b.size(), received.data());
  CHECK(std::vector<uint8_t>(received.begin(), received.begin() + 2000) == b);
  const auto at_d = outgoing.write(d.data(), d.size());  // now it does
  REQUIRE(at_d);
  CHECK(*at_d % 4096 == 0);
  incoming->read(*at_c, c.size(), received.data());
  CHECK(std::vector<uint8_t>(received.begin(), received.begin() + 1500) == c);
  incoming->read(*at_d, d.size(), received.data());
  CHECK(std::vector<uint8_t>(received.begin(), received.begin() + 600) == d);
}

TEST_CASE("ps payload ring: reading what the sender did not write is an error, not a read of stale bytes") {
  ps::OutgoingRing outgoing(4096);
  auto incoming = open_or_fail(outgoing.offer());
  const auto sent = pattern(100, 5);
  const auto position = outgoing.write(sent.data(), sent.size());
  REQUIRE(position);
  std::vector<uint8_t> received(4096);
  CHECK_THROWS_WITH(incoming->read(*position, 200, received.data()), Contains("that the peer did not write"));
  CHECK_THROWS_WITH(incoming->read(*position + 128, 10, received.data()), Contains("that the peer did not write"));
  incoming->read(*position, sent.size(), received.data());
  CHECK_THROWS_WITH(incoming->read(*position, sent.size(), received.data()), Contains("did not write"));  // twice
}

TEST_CASE("ps payload ring: a peer on another host, or a descriptor that is not the ring, is declined") {
  ps::OutgoingRing outgoing(4096);
  std::string why_not;
  auto elsewhere = outgoing.offer();
  elsewhere.host = "another-machine/" + elsewhere.host;
  CHECK_FALSE(ps::IncomingRing::open(elsewhere, &why_not));
  CHECK_THAT(why_not, Contains("another host"));

  auto wrong_token = outgoing.offer();
  wrong_token.token ^= 1;
  CHECK_FALSE(ps::IncomingRing::open(wrong_token, &why_not));
  CHECK_THAT(why_not, Contains("is not the peer's ring"));

  auto not_a_ring = outgoing.offer();
  not_a_ring.fd = 0;  // standard input
  CHECK_FALSE(ps::IncomingRing::open(not_a_ring, &why_not));
  CHECK_FALSE(why_not.empty());

  auto closed = outgoing.offer();
  outgoing.close_descriptor();  // what the sender does once the peer has mapped it
  CHECK_FALSE(ps::IncomingRing::open(closed, &why_not));
}
