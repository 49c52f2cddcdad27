// pipeline/same_host_rings: messages between neighbouring ranks of one host through shared-memory rings
// (forked ranks on Gloo). Both ranks send more than the rings hold before either receives, in an order
// the receiver does not follow, so the rings fill, wrap around, queue sends, split messages into fragments
// and set messages (and first fragments) aside.
#include "catch_with_torch.h"

#include <torchpar/pipeline/same_host_rings.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstring>

#include "harness.h"

namespace pipeline = torchpar::pipeline;
using torchpar::testing::run_on_ranks;
using Catch::Matchers::Contains;

namespace {

constexpr int64_t kRingBytes = 64 << 10;  // larger messages than a quarter of it go in fragments

at::Tensor pattern(int64_t bytes, int seed) {
  auto tensor = at::empty({bytes}, at::kByte);
  auto* data = tensor.data_ptr<uint8_t>();
  for (int64_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>((i * 7 + seed * 13) % 251);
  return tensor;
}

} // namespace

TEST_CASE("pipeline rings: every message arrives whole, in any receive order, through full and wrapping rings") {
  run_on_ranks(2, [](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto rings = pipeline::SameHostRings::connect(*pg, kRingBytes);
    REQUIRE(rings);
    const int peer = 1 - rank;
    REQUIRE(rings->connects(peer));
    // 60 messages of 0 bytes to twice the ring (in fragments), about 1.3 MB in all: twenty rings' worth each way.
    const std::vector<int64_t> sizes = {0, 1, 63, 64, 65, 4096, 16320, 16321, 40000, 131072};
    constexpr int kMessages = 60;
    std::vector<c10::intrusive_ptr<c10d::Work>> sends;
    for (int i = 0; i < kMessages; ++i) {
      sends.push_back(rings->send(pattern(sizes[i % sizes.size()], i + 100 * rank), peer, i));
    }
    // Received in reverse within blocks of 7: most arrive before their receive is posted.
    std::vector<int> order;
    for (int block = 0; block < kMessages; block += 7) {
      for (int i = std::min(block + 6, kMessages - 1); i >= block; --i) order.push_back(i);
    }
    for (int i : order) {
      auto buffer = at::zeros({sizes[i % sizes.size()]}, at::kByte);
      rings->recv(buffer, peer, i)->wait();
      INFO("message " << i << " of " << buffer.numel() << " bytes");
      CHECK(buffer.equal(pattern(buffer.numel(), i + 100 * peer)));
    }
    for (auto& work : sends) work->wait();
    pg->barrier()->wait();
  });
}

TEST_CASE("pipeline rings: a ring emptied near its start takes a quarter of its bytes before the reader drains it") {
  // GPipe's last stage sends a gradient after each backward while the previous stage computes: once the ring was
  // emptied, every one of them must go in at once, not wait in the sender's queue until the sender next waits.
  run_on_ranks(2, [](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto rings = pipeline::SameHostRings::connect(*pg, kRingBytes);
    REQUIRE(rings);
    constexpr int64_t kMessageBytes = 2048;
    constexpr int kMessages = 6;  // with their records, under a quarter of the ring
    if (rank == 0) {
      rings->send(pattern(kMessageBytes, 0), 1, 0)->wait();
      pg->barrier()->wait();  // rank 1 received it: the ring is empty, just past its first record
      std::vector<c10::intrusive_ptr<c10d::Work>> sends;
      for (int i = 1; i <= kMessages; ++i) sends.push_back(rings->send(pattern(kMessageBytes, i), 1, i));
      for (int i = 0; i < kMessages; ++i) {
        INFO("send " << i + 1 << " of " << kMessages);
        CHECK(sends[static_cast<size_t>(i)]->isCompleted());
      }
      pg->barrier()->wait();
    } else {
      auto first = at::zeros({kMessageBytes}, at::kByte);
      rings->recv(first, 0, 0)->wait();
      pg->barrier()->wait();
      pg->barrier()->wait();  // every send was written before this rank drains
      for (int i = 1; i <= kMessages; ++i) {
        auto buffer = at::zeros({kMessageBytes}, at::kByte);
        rings->recv(buffer, 0, i)->wait();
        CHECK(buffer.equal(pattern(kMessageBytes, i)));
      }
    }
    pg->barrier()->wait();
  });
}

TEST_CASE("pipeline rings: a receive of another size fails naming both sizes, a dead sender long before the timeout") {
  run_on_ranks(2, [](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto rings = pipeline::SameHostRings::connect(*pg, kRingBytes);
    REQUIRE(rings);
    if (rank == 1) {  // not rank 0: it holds the harness's store
      rings->send(pattern(100, 1), 0, 5)->wait();
      pg->barrier()->wait();
      torchpar::testing::leave_abruptly();  // its process is gone; nothing else will come
    }
    auto wrong = at::empty({200}, at::kByte);
    CHECK_THROWS_WITH(rings->recv(wrong, 1, 5)->wait(),
                      Contains("rank 1 sent 100 bytes for this message, the receive expected 200"));
    pg->barrier()->wait();
    const auto started = std::chrono::steady_clock::now();
    auto never = at::empty({100}, at::kByte);
    CHECK_THROWS_WITH(rings->recv(never, 1, 6)->wait(),
                      Contains("waiting for a message from rank 1: its process (") &&
                          Contains(") has exited"));
    // Far inside the group's timeout (60 s): seen by its process state, not by waiting (~0.05 s; ~1 s under TSan).
    CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(10));
  });
}

TEST_CASE("pipeline rings: only neighbours get rings, and one rank without them turns them off for all") {
  run_on_ranks(4, [](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto rings = pipeline::SameHostRings::connect(*pg, kRingBytes);
    REQUIRE(rings);
    CHECK(rings->connects((rank + 1) % 4));
    CHECK(rings->connects((rank + 3) % 4));
    CHECK_FALSE(rings->connects((rank + 2) % 4));
    CHECK_FALSE(pipeline::SameHostRings::connect(*pg, rank == 2 ? 0 : kRingBytes));
  });
}
