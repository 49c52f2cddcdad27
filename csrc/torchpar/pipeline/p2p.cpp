#include <torchpar/pipeline/p2p.h>

#include <torchpar/common/error_message.h>
#include <torchpar/pipeline/same_host_rings.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <sstream>

namespace torchpar::pipeline {
namespace {

constexpr int64_t kHeaderVersion = 1;
constexpr int64_t kHeaderSlots = 64;
constexpr int kMaxTensors = 15;
constexpr int kChannels = 3 * kMaxTensors + 1;

// Channel 0: header; then per tensor: guessed-shape data, data after a shape change, gradient.
int tag_of(int stage, int microbatch, int channel) {
  return (stage * kMaxMicrobatches + microbatch) * kChannels + channel;
}
int guessed_channel(size_t index) { return 1 + static_cast<int>(index); }
int changed_channel(size_t index) { return 1 + kMaxTensors + static_cast<int>(index); }
int gradient_channel(size_t index) { return 1 + 2 * kMaxTensors + static_cast<int>(index); }

at::Tensor encode_header(const TensorMetas& metas, int stage, int microbatch) {
  std::vector<int64_t> fields{kHeaderVersion, static_cast<int64_t>(metas.size())};
  for (const auto& meta : metas) {
    fields.push_back(static_cast<int64_t>(meta.dtype));
    fields.push_back(static_cast<int64_t>(meta.sizes.size()));
    fields.insert(fields.end(), meta.sizes.begin(), meta.sizes.end());
  }
  TORCH_CHECK(metas.size() <= kMaxTensors && fields.size() <= kHeaderSlots, "pipeline: the activations sent to stage ",
              stage, " for micro-batch ", microbatch, " (", describe(metas), ") do not fit a message header (at most ",
              kMaxTensors, " tensors, ", kHeaderSlots, " shape fields)");
  auto header = at::zeros({kHeaderSlots}, at::kLong);
  std::copy(fields.begin(), fields.end(), header.data_ptr<int64_t>());
  return header;
}

TensorMetas decode_header(const at::Tensor& header, int stage, int microbatch) {
  const int64_t* fields = header.data_ptr<int64_t>();
  TORCH_CHECK(fields[0] == kHeaderVersion, "pipeline stage ", stage, ", micro-batch ", microbatch,
              ": activation header of unknown version ", fields[0]);
  TensorMetas metas(fields[1]);
  int64_t at = 2;
  for (auto& meta : metas) {
    meta.dtype = static_cast<c10::ScalarType>(fields[at++]);
    const int64_t dims = fields[at++];
    meta.sizes.assign(fields + at, fields + at + dims);
    at += dims;
  }
  return metas;
}

void wait_or_explain(c10d::Work& work, const char* what, int stage, int microbatch, int peer) {
  try {
    work.wait();
  } catch (const std::exception& error) {
    TORCH_CHECK(false, "pipeline stage ", stage, ", micro-batch ", microbatch, ": ", what, " rank ", peer,
                " failed: ", message_of(error));
  }
}

} // namespace

TensorMetas metas_of(const Tensors& tensors) {
  TensorMetas metas;
  for (const auto& tensor : tensors) {
    metas.push_back({tensor.scalar_type(), tensor.sizes().vec()});
  }
  return metas;
}

std::string describe(const TensorMetas& metas) {
  std::ostringstream text;
  for (size_t i = 0; i < metas.size(); ++i) {
    text << (i ? ", " : "") << "[";
    for (size_t d = 0; d < metas[i].sizes.size(); ++d) {
      text << (d ? ", " : "") << metas[i].sizes[d];
    }
    text << "] " << c10::toString(metas[i].dtype);
  }
  return text.str();
}

bool carries_gradient(const TensorMeta& meta) { return c10::isFloatingType(meta.dtype) || c10::isComplexType(meta.dtype); }

StageLinks::StageLinks(c10::intrusive_ptr<c10d::ProcessGroup> group, const c10::Device& device)
    : group_(std::move(group)), device_(device), guess_shapes_(!device.is_cuda()) {
  if (device_.is_cpu()) rings_ = SameHostRings::connect(*group_, SameHostRings::default_ring_bytes());
}

StageLinks::~StageLinks() = default;

bool StageLinks::through_rings(int peer) const {
  return rings_ && rings_->connects(peer);
}

c10::intrusive_ptr<c10d::Work> StageLinks::post_send(std::vector<at::Tensor>& data, int destination, int tag) {
  if (through_rings(destination)) return rings_->send(data[0], destination, tag);
  return group_->send(data, destination, tag);
}

c10::intrusive_ptr<c10d::Work> StageLinks::post_recv(std::vector<at::Tensor>& buffer, int source, int tag) {
  if (through_rings(source)) return rings_->recv(buffer[0], source, tag);
  return group_->recv(buffer, source, tag);
}

void StageLinks::send(const Tensors& tensors, int destination, int stage, int microbatch, int (*channel)(size_t),
                      const std::string& what) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<at::Tensor> data{tensors[i].contiguous()};
    sends_.push_back({data, post_send(data, destination, tag_of(stage, microbatch, channel(i))), what});
  }
}

void StageLinks::send_activations(const Tensors& tensors, int stage, int microbatch, int destination) {
  const auto metas = metas_of(tensors);
  const std::string what = "sending stage " + std::to_string(stage) + "'s input for micro-batch " +
                           std::to_string(microbatch) + " to rank " + std::to_string(destination);
  std::vector<at::Tensor> header{encode_header(metas, stage, microbatch).to(device_)};
  sends_.push_back({header, post_send(header, destination, tag_of(stage, microbatch, 0)), what});
  auto last = last_sent_.find(stage);
  const bool guessed = guess_shapes_ && last != last_sent_.end();
  if (guessed && last->second == metas) {
    send(tensors, destination, stage, microbatch, guessed_channel, what);
  } else {
    if (guessed) {  // the receiver posted receives of the old shapes: fill them with placeholders
      Tensors placeholders;
      for (const auto& meta : last->second) {
        placeholders.push_back(at::empty(meta.sizes, at::TensorOptions().dtype(meta.dtype).device(device_)));
      }
      send(placeholders, destination, stage, microbatch, guessed_channel, what);
    }
    send(tensors, destination, stage, microbatch, changed_channel, what);
  }
  last_sent_[stage] = metas;
}

Tensors StageLinks::receive(const TensorMetas& metas, int source, int stage, int microbatch, int (*channel)(size_t),
                            std::vector<c10::intrusive_ptr<c10d::Work>>* posted) {
  Tensors data;
  for (size_t i = 0; i < metas.size(); ++i) {
    std::vector<at::Tensor> buffer{at::empty(metas[i].sizes, at::TensorOptions().dtype(metas[i].dtype).device(device_))};
    data.push_back(buffer[0]);
    posted->push_back(post_recv(buffer, source, tag_of(stage, microbatch, channel(i))));
  }
  return data;
}

void StageLinks::read_header(int stage, int microbatch, Incoming& incoming) {
  if (incoming.metas) {
    return;
  }
  if (!incoming.header_work) {
    std::vector<at::Tensor> buffer{incoming.header};
    incoming.header_work = post_recv(buffer, incoming.source, tag_of(stage, microbatch, 0));
  }
  wait_or_explain(*incoming.header_work, "receiving the activation header from", stage, microbatch, incoming.source);
  incoming.metas = decode_header(incoming.header.cpu(), stage, microbatch);
  last_received_[stage] = *incoming.metas;
}

void StageLinks::wait_for_previous_header(int stage, int microbatch) {
  auto previous = incoming_.find({stage, microbatch - 1});
  if (previous != incoming_.end()) {
    read_header(stage, microbatch - 1, previous->second);
  }
}

void StageLinks::post_activations(int stage, int microbatch, int source) {
  wait_for_previous_header(stage, microbatch);
  Incoming incoming;
  incoming.source = source;
  incoming.header = at::empty({kHeaderSlots}, at::TensorOptions().dtype(at::kLong).device(device_));
  if (guess_shapes_) {
    std::vector<at::Tensor> buffer{incoming.header};
    incoming.header_work = post_recv(buffer, source, tag_of(stage, microbatch, 0));
    auto last = last_received_.find(stage);
    if (last != last_received_.end()) {
      incoming.guess = last->second;
      incoming.guessed_data = receive(last->second, source, stage, microbatch, guessed_channel, &incoming.guessed_work);
    }
  }
  incoming_[{stage, microbatch}] = std::move(incoming);
}

Tensors StageLinks::receive_activations(int stage, int microbatch) {
  auto found = incoming_.find({stage, microbatch});
  TORCH_INTERNAL_ASSERT(found != incoming_.end(), "pipeline: no receive posted for stage ", stage, ", micro-batch ",
                        microbatch);
  Incoming incoming = std::move(found->second);
  incoming_.erase(found);
  read_header(stage, microbatch, incoming);
  for (auto& work : incoming.guessed_work) {
    wait_or_explain(*work, "receiving activations from", stage, microbatch, incoming.source);
  }
  if (incoming.guess && *incoming.guess == *incoming.metas) {
    return incoming.guessed_data;
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> work;
  auto data = receive(*incoming.metas, incoming.source, stage, microbatch, changed_channel, &work);
  for (auto& receive : work) {
    wait_or_explain(*receive, "receiving activations from", stage, microbatch, incoming.source);
  }
  return data;
}

void StageLinks::send_gradients(const Tensors& gradients, const TensorMetas& metas, int stage, int microbatch,
                                int destination) {
  TORCH_INTERNAL_ASSERT(gradients.size() == metas.size());
  const std::string what = "sending the gradient of stage " + std::to_string(stage) + "'s output for micro-batch " +
                           std::to_string(microbatch) + " to rank " + std::to_string(destination);
  for (size_t i = 0; i < metas.size(); ++i) {
    if (!carries_gradient(metas[i])) {
      continue;
    }
    std::vector<at::Tensor> data{
        gradients[i].defined()
            ? gradients[i].contiguous()
            : at::zeros(metas[i].sizes, at::TensorOptions().dtype(metas[i].dtype).device(device_))};
    sends_.push_back({data, post_send(data, destination, tag_of(stage, microbatch, gradient_channel(i))), what});
  }
}

PendingGradients StageLinks::post_gradients(const TensorMetas& metas, int stage, int microbatch, int source) {
  PendingGradients pending;
  for (size_t i = 0; i < metas.size(); ++i) {
    if (!carries_gradient(metas[i])) {
      pending.data_.emplace_back();
      continue;
    }
    std::vector<at::Tensor> buffer{
        at::empty(metas[i].sizes, at::TensorOptions().dtype(metas[i].dtype).device(device_))};
    pending.data_.push_back(buffer[0]);
    pending.work_.push_back(post_recv(buffer, source, tag_of(stage, microbatch, gradient_channel(i))));
  }
  pending.stage_ = stage;
  pending.microbatch_ = microbatch;
  pending.source_ = source;
  return pending;
}

Tensors StageLinks::wait(PendingGradients& pending) {
  for (auto& work : pending.work_) {
    wait_or_explain(*work, "receiving gradients from", pending.stage_, pending.microbatch_, pending.source_);
  }
  return pending.data_;
}

void StageLinks::wait_sends() {
  for (auto& send : sends_) {
    try {
      send.work->wait();
    } catch (const std::exception& error) {
      const std::string what = send.what + " failed: " + message_of(error);
      sends_.clear();
      TORCH_CHECK(false, "pipeline: ", what);
    }
  }
  sends_.clear();
}

void StageLinks::discard_pending() {
  incoming_.clear();
  sends_.clear();
  if (rings_) rings_->discard_pending();
  // Which transfers of the failed step completed is unknown: the next step starts without guesses.
  last_sent_.clear();
  last_received_.clear();
}

} // namespace torchpar::pipeline
