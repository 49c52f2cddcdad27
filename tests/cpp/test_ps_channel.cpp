// ps/channel: one peer of the parameter service over a process group's send/recv (2 forked ranks on
// Gloo). Payload sizes cover every path: none, inline in the frame, one past it, and large sizes the
// first time (a fresh receive) and again (a slot kept posted for that size) — through Gloo, through
// the same-host payload rings, and through both when a ring has no room for some; payloads copied into
// their message, and payloads the message only views until it is sent.
#include "catch_with_torch.h"

#include <torchpar/ps/channel.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>

#include "harness.h"

namespace ps = torchpar::ps;
using torchpar::testing::run_on_ranks;
using Catch::Matchers::Contains;

namespace {

struct Received {
  ps::MessageKind kind;
  int64_t request_id;
  std::vector<uint8_t> bytes;
};

// Collects what a channel receives until the peer's last message (kind Bye), or a failure.
struct Inbox {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Received> messages;
  std::vector<std::string> failures;
  bool done = false;

  bool on_message(ps::Message&& message) {
    std::lock_guard<std::mutex> lock(mutex);
    const auto* data = message.payload.defined() ? message.payload.data_ptr<uint8_t>() : nullptr;
    messages.push_back({message.frame.kind, message.frame.request_id,
                        std::vector<uint8_t>(data, data + message.frame.payload_bytes)});
    done = message.frame.kind == ps::MessageKind::Bye;
    changed.notify_all();
    return !done;
  }
  void on_failure(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex);
    failures.push_back(reason);
    changed.notify_all();
  }
  bool wait(const std::function<bool()>& until) {
    std::unique_lock<std::mutex> lock(mutex);
    return changed.wait_for(lock, std::chrono::seconds(60), until);
  }
};

std::vector<uint8_t> pattern(size_t bytes, int64_t seed) {
  std::vector<uint8_t> data(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>((i * 31 + seed) % 251);
  return data;
}

const std::vector<size_t> kSizes = {0, 10, ps::Frame::kInlineBytes, ps::Frame::kInlineBytes + 1, 100000, 100000,
                                    size_t{3} << 20, 100000, 7, size_t{3} << 20, size_t{3} << 20};
constexpr int64_t kLargePayloads = 7;  // the sizes past the frame's inline bytes

// Each rank sends every size to the other and checks what it received; returns how many payloads its
// end sent through its ring. `viewed`: each message only views its payload (WireWriter::put_data_view). The rings are offered with the first message and accepted with the
// second, so with `rings_first` both ranks exchange those two before the sizes.
// Each call takes its own tags: a channel's receives still posted when it goes are not the next one's.
int64_t exchange_every_size(int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t ring_bytes,
                            bool rings_first, ps::RingPayloads ring_payloads = ps::RingPayloads::Copied,
                            bool viewed = false) {
  static int calls = 0;
  const int tags = 2 * ps::kTagsPerDirection * calls++;
  Inbox inbox;
  const bool requester = rank == 0;
  ps::Channel channel(
      pg, 1 - rank, tags + (requester ? ps::kRequestTag : ps::kReplyTag),
      tags + (requester ? ps::kReplyTag : ps::kRequestTag),
      [&](ps::Message&& message) { return inbox.on_message(std::move(message)); },
      [&](const std::string& reason) { inbox.on_failure(reason); }, ring_bytes, ring_payloads);
  size_t prelude = 0;
  if (rings_first) {
    for (; prelude < 2; ++prelude) {
      channel.send(ps::make_message(ps::MessageKind::Ok, -1));
      REQUIRE(inbox.wait([&] { return inbox.messages.size() > prelude || !inbox.failures.empty(); }));
    }
  }
  for (size_t i = 0; i < kSizes.size(); ++i) {
    const auto id = static_cast<int64_t>(i) + 100 * rank;
    auto payload = pattern(kSizes[i], static_cast<int64_t>(i) + rank);
    if (viewed) {
      // The message points at `payload`; overwritten once sent, it must arrive as it was at send().
      ps::WireWriter writer;
      writer.put_data_view(payload.data(), payload.size());
      channel.send(ps::make_message(ps::MessageKind::Push, id, std::move(writer)));
      std::fill(payload.begin(), payload.end(), uint8_t{0xEE});
    } else {
      channel.send(ps::make_message(ps::MessageKind::Push, id, std::move(payload)));
    }
  }
  channel.send(ps::make_message(ps::MessageKind::Bye, -1));
  REQUIRE(inbox.wait([&] { return inbox.done || !inbox.failures.empty(); }));
  CHECK(inbox.failures.empty());
  REQUIRE(inbox.messages.size() == prelude + kSizes.size() + 1);
  const int peer = 1 - rank;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    INFO("message " << i << " of " << kSizes[i] << " bytes");
    const auto& received = inbox.messages[prelude + i];
    CHECK(received.kind == ps::MessageKind::Push);
    CHECK(received.request_id == static_cast<int64_t>(i) + 100 * peer);
    CHECK(received.bytes == pattern(kSizes[i], static_cast<int64_t>(i) + peer));
  }
  pg->barrier()->wait();  // both received everything before either channel goes
  return channel.payloads_sent_through_ring();
}

} // namespace

TEST_CASE("ps channel: messages arrive whole and in order, whatever their size, in both directions") {
  run_on_ranks(2, [](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    {
      INFO("through Gloo (no ring)");
      CHECK(exchange_every_size(rank, pg, 0, true) == 0);
    }
    {
      INFO("sent while the ring's offer is still unanswered (some through Gloo, later ones maybe the ring)");
      exchange_every_size(rank, pg, 16 << 20, false);
    }
    {
      INFO("through the same-host rings");
      CHECK(exchange_every_size(rank, pg, 16 << 20, true) == kLargePayloads);
    }
    {
      INFO("through the same-host rings, each payload lent to the callback in place (the inbox copies it)");
      CHECK(exchange_every_size(rank, pg, 16 << 20, true, ps::RingPayloads::Lent) == kLargePayloads);
    }
    {
      INFO("payloads that view the sender's data: through Gloo, then the rings");
      CHECK(exchange_every_size(rank, pg, 0, true, ps::RingPayloads::Copied, true) == 0);
      CHECK(exchange_every_size(rank, pg, 16 << 20, true, ps::RingPayloads::Copied, true) == kLargePayloads);
    }
    {
      INFO("through a ring too small for some: those through Gloo, in order with the others");
      // 200 000 bytes hold the 16 KB and 100 000-byte payloads when the receiver has read the ones
      // before (it may not have yet), never a 3 MiB one.
      const auto through_ring = exchange_every_size(rank, pg, 200000, true);
      CHECK(through_ring >= 1);
      CHECK(through_ring <= 4);
    }
  });
}

TEST_CASE("ps channel: a peer that dies is reported to the failure callback once") {
  run_on_ranks(2, [](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    Inbox inbox;
    if (rank == 1) {
      pg->barrier()->wait();
      torchpar::testing::leave_abruptly();  // gone without a word: its connections close
    }
    {
      ps::Channel channel(
          pg, 1, ps::kRequestTag, ps::kReplyTag,
          [&](ps::Message&& message) { return inbox.on_message(std::move(message)); },
          [&](const std::string& reason) { inbox.on_failure(reason); });
      pg->barrier()->wait();
      REQUIRE(inbox.wait([&] { return !inbox.failures.empty(); }));
    }  // the destructor joined the channel's threads: no callback can come later
    CHECK(inbox.failures.size() == 1);
    CHECK(inbox.messages.empty());
    // Gloo says "closed" after an orderly FIN, "reset" when the peer died with bytes it never read.
    CHECK_THAT(inbox.failures[0], Contains("Connection closed by peer") || Contains("Connection reset by peer"));
  });
}
