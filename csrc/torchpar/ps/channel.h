#pragma once
// One peer of the parameter service, over the process group's point-to-point ops. send() posts the
// transfers at once from the calling thread (in call order); a waiter thread then waits for them to
// complete, and a receiver thread receives the peer's messages and hands each to a callback. A
// broken connection (the peer died) reaches the failure callback once. Between two processes on one
// host, large payloads go through shared-memory rings (payload_ring.h) once both ends have mapped them.
#include <torchpar/ps/payload_ring.h>
#include <torchpar/ps/wire_format.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

namespace c10d {
class ProcessGroup;
class Work;
} // namespace c10d

namespace torchpar::ps {

// Tags of the two directions; each uses kTagsPerDirection from its base (frame, payloads).
constexpr int kTagsPerDirection = 16;
constexpr int kRequestTag = 0x50530;
constexpr int kReplyTag = kRequestTag + kTagsPerDirection;

struct Message {
  Frame frame;
  at::Tensor payload; // uint8 [frame.payload_bytes]; undefined when empty or `viewing`
  // Instead of `payload`, one that views data of the sender's (WireWriter::put_data_view): the channel
  // copies it once, at send(), straight to where it goes.
  std::shared_ptr<const WireWriter> viewing;
};

Message make_message(MessageKind kind, int64_t request_id, std::vector<uint8_t> payload = {});
Message make_message(MessageKind kind, int64_t request_id, WireWriter payload);

// What a message's payload that came through the ring is: a copy of its own, or (Lent) a view of the
// ring's bytes, valid only until the message callback returns — for a receiver that keeps nothing of a
// payload past its callback without copying it (it saves a copy and an allocation per message).
enum class RingPayloads { Copied, Lent };

class Channel {
 public:
  // Returns false to stop receiving (the peer's last message arrived).
  using OnMessage = std::function<bool(Message&&)>;
  using OnFailure = std::function<void(const std::string&)>;

  // `ring_bytes`: the capacity of this end's outgoing payload ring; 0 sends every payload through Gloo.
  Channel(c10::intrusive_ptr<c10d::ProcessGroup> group, int peer, int outgoing_tag, int incoming_tag,
          OnMessage on_message, OnFailure on_failure, int64_t ring_bytes = default_ring_bytes(),
          RingPayloads ring_payloads = RingPayloads::Copied);
  // Waits for what was sent (at most the group's timeout each), then stops; a receive still
  // waiting is abandoned.
  ~Channel();

  void send(const Message& message);
  int peer() const { return peer_; }
  // Payloads sent through this end's ring so far.
  int64_t payloads_sent_through_ring() const;

  // TORCHPAR_PS_RING_BYTES, else 64 MiB.
  static int64_t default_ring_bytes();

 private:
  void wait_loop();
  void receive_loop();
  void receive(std::vector<at::Tensor>& buffer, int tag);
  at::Tensor receive_payload(int64_t bytes);
  void post_slot_receive(size_t slot);
  void fail(const std::string& reason);
  void attach_ring_fields(Frame& frame, uint8_t* bytes, const Message& message);
  void read_ring_fields(const Frame& frame, const uint8_t* bytes);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int peer_;
  int outgoing_tag_;
  int incoming_tag_;
  OnMessage on_message_;
  OnFailure on_failure_;

  mutable std::mutex mutex_;
  std::condition_variable posted_;
  std::deque<c10::intrusive_ptr<c10d::Work>> in_flight_; // sends posted, not yet waited for
  bool stopping_ = false;
  bool failed_ = false;
  std::string unreported_failure_; // a send failed in send(); the waiter thread reports it
  c10::intrusive_ptr<c10d::Work> pending_receive_;
  // Payloads too large for the frame: the first few sizes each get a tag ("slot") on which the
  // receiver keeps a receive of that size posted, so a payload of a size seen before moves at once
  // instead of waiting for its receive to be posted (a round trip). Both ends see the same sizes
  // in the same order, so they assign the same slots.
  std::vector<int64_t> sent_slot_sizes_;
  std::vector<int64_t> received_slot_sizes_;
  std::set<int64_t> sent_sizes_seen_;
  std::set<int64_t> received_sizes_seen_;
  std::vector<std::pair<at::Tensor, c10::intrusive_ptr<c10d::Work>>> slot_receives_;
  // Same-host payloads: this end's ring (until the peer declines it), the peer's once mapped (only the
  // receiver thread touches it), and what the next frame must say about them.
  std::unique_ptr<OutgoingRing> outgoing_ring_;
  bool ring_offered_ = false;
  bool peer_mapped_ring_ = false;
  std::unique_ptr<IncomingRing> incoming_ring_;
  RingPayloads ring_payloads_;
  int64_t answer_due_ = 0;  // Frame::kRingAccepted or kRingDeclined, to say in the next frame sent
  int64_t payloads_through_ring_ = 0;
  std::thread waiter_;
  std::thread receiver_;
};

} // namespace torchpar::ps
