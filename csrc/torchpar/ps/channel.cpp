#include <torchpar/ps/channel.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace torchpar::ps {
namespace {

// Liveness comes from broken connections and the requests' own deadlines, not from how long a
// peer stays quiet: a worker may compute for hours between two pushes.
constexpr std::chrono::milliseconds kQuietPeerWait = std::chrono::hours(24 * 365);

} // namespace

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

Channel::Channel(c10::intrusive_ptr<c10d::ProcessGroup> group, int peer, int outgoing_tag, int incoming_tag,
                 OnMessage on_message, OnFailure on_failure)
    : group_(std::move(group)),
      peer_(peer),
      outgoing_tag_(outgoing_tag),
      incoming_tag_(incoming_tag),
      on_message_(std::move(on_message)),
      on_failure_(std::move(on_failure)) {
  sender_ = std::thread([this] { send_loop(); });
  receiver_ = std::thread([this] { receive_loop(); });
}

Channel::~Channel() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  queued_.notify_all();
  sender_.join();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (pending_receive_) {
      pending_receive_->abort();
    }
  }
  receiver_.join();
}

void Channel::send(Message message) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_) {
      return;
    }
    outbox_.push_back(std::move(message));
  }
  queued_.notify_one();
}

void Channel::fail(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_ || stopping_) {
      failed_ = true;
      return;
    }
    failed_ = true;
  }
  queued_.notify_all();
  on_failure_(reason);
}


void Channel::send_loop() {
  while (true) {
    Message message;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      queued_.wait(lock, [&] { return !outbox_.empty() || stopping_ || failed_; });
      if (outbox_.empty() || failed_) {
        return;
      }
      message = std::move(outbox_.front());
      outbox_.pop_front();
    }
    try {
      std::vector<at::Tensor> frame{at::empty({Frame::kFields}, at::kLong)};
      encode_frame(message.frame, frame[0].data_ptr<int64_t>());
      // A send waits for the peer's receive, at most the group's timeout.
      group_->send(frame, peer_, outgoing_tag_)->wait();
      if (message.payload.defined()) {
        std::vector<at::Tensor> payload{message.payload};
        group_->send(payload, peer_, outgoing_tag_ + 1)->wait();
      }
    } catch (const std::exception& error) {
      fail(error.what());
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

void Channel::receive_loop() {
  while (true) {
    Message message;
    try {
      std::vector<at::Tensor> frame{at::empty({Frame::kFields}, at::kLong)};
      receive(frame, incoming_tag_);
      message.frame = decode_frame(frame[0].data_ptr<int64_t>());
      if (message.frame.payload_bytes > 0) {
        std::vector<at::Tensor> payload{at::empty({message.frame.payload_bytes}, at::kByte)};
        receive(payload, incoming_tag_ + 1);
        message.payload = payload[0];
      }
    } catch (const std::exception& error) {
      fail(error.what());
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
    }
    if (!on_message_(std::move(message))) {
      return;
    }
  }
}

} // namespace torchpar::ps
