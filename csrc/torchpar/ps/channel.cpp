#include <torchpar/ps/channel.h>

#include <torchpar/common/error_message.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <c10/util/Logging.h>

#include <cstring>
#include <optional>
#include <set>
#include <utility>

namespace torchpar::ps {
namespace {

// Liveness comes from broken connections and the requests' own deadlines, not from how long a
// peer stays quiet: a worker may compute for hours between two pushes.
constexpr std::chrono::milliseconds kQuietPeerWait = std::chrono::hours(24 * 365);
// Tags from a direction's base: the frame, a payload of a size without a slot, then the slots.
constexpr int kFreshPayloadTag = 1;
constexpr int kFirstSlotTag = 2;
constexpr size_t kSlots = kTagsPerDirection - kFirstSlotTag;
constexpr int64_t kLargestSlotBytes = int64_t{64} << 20;

// The slot of `bytes` in `sizes`; a size gets one (`added`) the second time it is seen while slots
// are free — one-off sizes (registrations) never take one. -1 when it has none.
int slot_of(std::vector<int64_t>& sizes, std::set<int64_t>& seen_once, int64_t bytes, bool* added) {
  *added = false;
  for (size_t slot = 0; slot < sizes.size(); ++slot) {
    if (sizes[slot] == bytes) return static_cast<int>(slot);
  }
  if (sizes.size() == kSlots || bytes > kLargestSlotBytes || seen_once.insert(bytes).second) return -1;
  sizes.push_back(bytes);
  *added = true;
  return static_cast<int>(sizes.size()) - 1;
}

std::vector<uint8_t> encode_offer(const RegionOffer& offer) {
  WireWriter writer;
  put_offer(writer, offer);
  return writer.release();
}

RegionOffer decode_offer(const uint8_t* bytes) {
  WireReader reader(bytes, Frame::kOfferBytes);
  return get_offer(reader);
}

} // namespace

int64_t Channel::default_ring_bytes() {
  return ring_bytes_from_environment("TORCHPAR_PS_RING_BYTES", int64_t{64} << 20, "0 sends every payload through Gloo");
}

Message make_message(MessageKind kind, int64_t request_id, std::vector<uint8_t> payload) {
  Message message;
  message.frame = Frame{kind, request_id, static_cast<int64_t>(payload.size())};
  if (!payload.empty()) {
    auto* owned = new std::vector<uint8_t>(std::move(payload));
    message.payload = at::from_blob(
        owned->data(), {static_cast<int64_t>(owned->size())}, [owned](void*) { delete owned; }, at::kByte);
  }
  return message;
}

Message make_message(MessageKind kind, int64_t request_id, WireWriter payload) {
  if (!payload.has_views()) return make_message(kind, request_id, payload.release());
  Message message;
  message.frame = Frame{kind, request_id, static_cast<int64_t>(payload.size())};
  message.viewing = std::make_shared<const WireWriter>(std::move(payload));
  return message;
}

namespace {

void copy_payload(const Message& message, uint8_t* out) {
  if (message.viewing) {
    message.viewing->copy_to(out);
  } else if (message.payload.defined()) {
    std::memcpy(out, message.payload.const_data_ptr(), message.frame.payload_bytes);
  }
}

// The payload as a tensor of its own, for a transfer that reads it after send() returns.
at::Tensor owned_payload(const Message& message) {
  if (!message.viewing) return message.payload;
  auto payload = at::empty({message.frame.payload_bytes}, at::kByte);
  copy_payload(message, payload.data_ptr<uint8_t>());
  return payload;
}

} // namespace

Channel::Channel(c10::intrusive_ptr<c10d::ProcessGroup> group, int peer, int outgoing_tag, int incoming_tag,
                 OnMessage on_message, OnFailure on_failure, int64_t ring_bytes, RingPayloads ring_payloads)
    : group_(std::move(group)),
      peer_(peer),
      outgoing_tag_(outgoing_tag),
      incoming_tag_(incoming_tag),
      on_message_(std::move(on_message)),
      on_failure_(std::move(on_failure)),
      ring_payloads_(ring_payloads) {
  if (ring_bytes > 0) {
    try {
      outgoing_ring_ = std::make_unique<OutgoingRing>(ring_bytes);
    } catch (const std::exception& error) {
      LOG(WARNING) << "torchpar.ps: payloads to rank " << peer_ << " go through Gloo: " << message_of(error);
    }
  }
  waiter_ = std::thread([this] { wait_loop(); });
  receiver_ = std::thread([this] { receive_loop(); });
}

Channel::~Channel() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  posted_.notify_all();
  waiter_.join();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (pending_receive_) {
      pending_receive_->abort();
    }
  }
  receiver_.join();
  for (auto& [buffer, work] : slot_receives_) {
    work->abort();
  }
}

void Channel::send(const Message& message) {
  std::vector<at::Tensor> frame{at::empty({Frame::kBytes}, at::kByte)};
  auto* bytes = frame[0].data_ptr<uint8_t>();
  const bool inline_payload = message.frame.payload_bytes <= Frame::kInlineBytes;
  if (inline_payload) {
    copy_payload(message, bytes + Frame::kFields * 8);
  }
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_ || !unreported_failure_.empty()) {
      return;
    }
    try {
      Frame header = message.frame;
      attach_ring_fields(header, bytes, message);
      encode_frame(header, reinterpret_cast<int64_t*>(bytes));
      in_flight_.push_back(group_->send(frame, peer_, outgoing_tag_));
      if (!inline_payload && header.ring_position < 0) {
        bool added = false;
        const int slot = slot_of(sent_slot_sizes_, sent_sizes_seen_, message.frame.payload_bytes, &added);
        const int tag = outgoing_tag_ + (slot < 0 || added ? kFreshPayloadTag : kFirstSlotTag + slot);
        std::vector<at::Tensor> payload{owned_payload(message)};
        in_flight_.push_back(group_->send(payload, peer_, tag));
      }
    } catch (const std::exception& error) {
      failure = message_of(error);
    }
  }
  if (!failure.empty()) {
    // Reported by the waiter thread: the caller may hold a lock the failure callback takes.
    std::lock_guard<std::mutex> lock(mutex_);
    if (unreported_failure_.empty()) unreported_failure_ = failure;
  }
  posted_.notify_one();
}

void Channel::attach_ring_fields(Frame& frame, uint8_t* bytes, const Message& message) {
  frame.ring_flags = answer_due_;
  answer_due_ = 0;
  if (outgoing_ring_ && !ring_offered_) {
    ring_offered_ = true;
    const auto offer = encode_offer(outgoing_ring_->offer());
    if (static_cast<int64_t>(offer.size()) <= Frame::kOfferBytes) {
      std::memcpy(bytes + Frame::kBytes - Frame::kOfferBytes, offer.data(), offer.size());
      frame.ring_flags |= Frame::kRingOffered;
    }
  }
  if (peer_mapped_ring_ && message.frame.payload_bytes > Frame::kInlineBytes) {
    // A ring without room now sends this payload through Gloo rather than wait for the peer.
    const auto position = outgoing_ring_->write(static_cast<size_t>(message.frame.payload_bytes),
                                                [&](uint8_t* out) { copy_payload(message, out); });
    if (position) {
      frame.ring_position = static_cast<int64_t>(*position);
      ++payloads_through_ring_;
    }
  }
}

void Channel::read_ring_fields(const Frame& frame, const uint8_t* bytes) {
  if (frame.ring_flags & Frame::kRingOffered) {
    std::string why_not;
    try {
      incoming_ring_ = IncomingRing::open(decode_offer(bytes + Frame::kBytes - Frame::kOfferBytes), &why_not);
    } catch (const std::exception& error) {
      why_not = "its offer is malformed: " + message_of(error);
    }
    if (!incoming_ring_) {
      LOG(INFO) << "torchpar.ps: payloads from rank " << peer_ << " keep going through Gloo: " << why_not;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    answer_due_ = incoming_ring_ ? Frame::kRingAccepted : Frame::kRingDeclined;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if ((frame.ring_flags & Frame::kRingAccepted) && outgoing_ring_ && ring_offered_) {
    peer_mapped_ring_ = true;
    outgoing_ring_->close_descriptor();
  }
  if (frame.ring_flags & Frame::kRingDeclined) {
    peer_mapped_ring_ = false;
    outgoing_ring_.reset();
  }
}

int64_t Channel::payloads_sent_through_ring() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return payloads_through_ring_;
}

void Channel::fail(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool quiet = failed_ || stopping_;
    failed_ = true;
    posted_.notify_all();
    if (quiet) return;
  }
  on_failure_(reason);
}

void Channel::wait_loop() {
  while (true) {
    c10::intrusive_ptr<c10d::Work> work;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      posted_.wait(lock, [&] { return !in_flight_.empty() || stopping_ || failed_ || !unreported_failure_.empty(); });
      if (!unreported_failure_.empty()) {
        const std::string reason = unreported_failure_;
        lock.unlock();
        fail(reason);
        return;
      }
      if (in_flight_.empty() || failed_) {
        return;
      }
      work = in_flight_.front();
      in_flight_.pop_front();
    }
    try {
      // Completes when the peer received it; a peer that stopped receiving costs the group's timeout.
      work->wait();
    } catch (const std::exception& error) {
      fail(message_of(error));
      return;
    }
  }
}

void Channel::receive(std::vector<at::Tensor>& buffer, int tag) {
  c10::intrusive_ptr<c10d::Work> work;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!stopping_, "torchpar.ps: channel to rank ", peer_, " closed");
    work = group_->recv(buffer, peer_, tag);
    pending_receive_ = work;
  }
  work->wait(kQuietPeerWait);
}

void Channel::post_slot_receive(size_t slot) {
  std::vector<at::Tensor> buffer{at::empty({received_slot_sizes_[slot]}, at::kByte)};
  auto work = group_->recv(buffer, peer_, incoming_tag_ + kFirstSlotTag + static_cast<int>(slot));
  std::lock_guard<std::mutex> lock(mutex_);
  if (slot == slot_receives_.size()) {
    slot_receives_.emplace_back(buffer[0], work);
  } else {
    slot_receives_[slot] = {buffer[0], work};
  }
}

at::Tensor Channel::receive_payload(int64_t bytes) {
  bool added = false;
  const int slot = slot_of(received_slot_sizes_, received_sizes_seen_, bytes, &added);
  if (slot >= 0 && !added) {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor payload;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_CHECK(!stopping_, "torchpar.ps: channel to rank ", peer_, " closed");
      std::tie(payload, work) = slot_receives_[slot];
      pending_receive_ = work;
    }
    work->wait(kQuietPeerWait);
    post_slot_receive(slot);
    return payload;
  }
  std::vector<at::Tensor> payload{at::empty({bytes}, at::kByte)};
  receive(payload, incoming_tag_ + kFreshPayloadTag);
  if (added) {
    post_slot_receive(slot);
  }
  return payload[0];
}

void Channel::receive_loop() {
  while (true) {
    Message message;
    std::optional<std::pair<uint64_t, size_t>> lent;  // ring bytes the message's payload views
    try {
      std::vector<at::Tensor> frame{at::empty({Frame::kBytes}, at::kByte)};
      receive(frame, incoming_tag_);
      const auto* bytes = frame[0].const_data_ptr<uint8_t>();
      message.frame = decode_frame(reinterpret_cast<const int64_t*>(bytes));
      read_ring_fields(message.frame, bytes);
      if (message.frame.ring_position >= 0) {
        TORCH_CHECK(incoming_ring_ && message.frame.payload_bytes > Frame::kInlineBytes, "torchpar.ps: rank ", peer_,
                    " sent a payload of ", message.frame.payload_bytes,
                    " bytes through a shared-memory ring this end has not mapped");
        const auto position = static_cast<uint64_t>(message.frame.ring_position);
        const auto size = static_cast<size_t>(message.frame.payload_bytes);
        if (ring_payloads_ == RingPayloads::Lent) {
          message.payload = at::from_blob(const_cast<void*>(incoming_ring_->view(position, size)),
                                          {message.frame.payload_bytes}, at::kByte);
          lent = {position, size};
        } else {
          message.payload = at::empty({message.frame.payload_bytes}, at::kByte);
          incoming_ring_->read(position, size, message.payload.data_ptr());
        }
      } else if (message.frame.payload_bytes > Frame::kInlineBytes) {
        message.payload = receive_payload(message.frame.payload_bytes);
      } else if (message.frame.payload_bytes > 0) {
        message.payload = frame[0].narrow(0, Frame::kFields * 8, message.frame.payload_bytes);
      }
    } catch (const std::exception& error) {
      fail(message_of(error));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
    }
    bool more = false;
    try {
      more = on_message_(std::move(message));
    } catch (const std::exception& error) {
      fail(std::string("handling a message failed: ") + message_of(error));
      return;
    }
    if (lent) incoming_ring_->release(lent->first, lent->second);
    if (!more) {
      return;
    }
  }
}

} // namespace torchpar::ps
