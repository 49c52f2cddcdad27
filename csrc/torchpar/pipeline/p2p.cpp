#include <torchpar/pipeline/p2p.h>

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
constexpr int kMaxMicrobatches = 4096;
constexpr int kTagsPerMicrobatch = 2 * kMaxTensors + 2;

// Channel 0: header; 1..15: activation tensors; 16..30: gradient tensors.
int tag_of(int stage, int microbatch, int channel) {
  TORCH_CHECK(microbatch < kMaxMicrobatches, "pipeline: at most ", kMaxMicrobatches, " micro-batches per step");
  return (stage * kMaxMicrobatches + microbatch) * kTagsPerMicrobatch + channel;
}
int activation_channel(size_t index) { return 1 + static_cast<int>(index); }
int gradient_channel(size_t index) { return 1 + kMaxTensors + static_cast<int>(index); }

at::Tensor encode_header(const std::vector<TensorMeta>& metas, int stage, int microbatch) {
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

std::vector<TensorMeta> decode_header(const at::Tensor& header, int stage, int microbatch) {
  const int64_t* fields = header.data_ptr<int64_t>();
  TORCH_CHECK(fields[0] == kHeaderVersion, "pipeline stage ", stage, ", micro-batch ", microbatch,
              ": activation header of unknown version ", fields[0]);
  std::vector<TensorMeta> metas(fields[1]);
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
                " failed: ", error.what());
  }
}

} // namespace

std::vector<TensorMeta> metas_of(const Tensors& tensors) {
  std::vector<TensorMeta> metas;
  for (const auto& tensor : tensors) {
    metas.push_back({tensor.scalar_type(), tensor.sizes().vec()});
  }
  return metas;
}

std::string describe(const std::vector<TensorMeta>& metas) {
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
    : group_(std::move(group)), device_(device) {}

void StageLinks::send_activations(const Tensors& tensors, int stage, int microbatch, int destination) {
  std::vector<at::Tensor> header{encode_header(metas_of(tensors), stage, microbatch)};
  if (device_.is_cuda()) {
    header[0] = header[0].to(device_);
  }
  const std::string what = "sending stage " + std::to_string(stage) + "'s input for micro-batch " +
                           std::to_string(microbatch) + " to rank " + std::to_string(destination);
  sends_.push_back({header, group_->send(header, destination, tag_of(stage, microbatch, 0)), what});

  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<at::Tensor> data{tensors[i].contiguous()};
    sends_.push_back({data, group_->send(data, destination, tag_of(stage, microbatch, activation_channel(i))), what});
  }
}

PendingActivations StageLinks::post_activations(int stage, int microbatch, int source) {
  PendingActivations pending;
  pending.stage_ = stage;
  pending.microbatch_ = microbatch;
  pending.source_ = source;
  pending.header_ = at::empty({kHeaderSlots}, at::TensorOptions().dtype(at::kLong).device(device_));
  // NCCL ignores tags and pairs messages in posting order, so there the header's receive waits
  // until the data before it in that order has been received (see wait).
  if (!device_.is_cuda()) {
    std::vector<at::Tensor> buffer{pending.header_};
    pending.header_work_ = group_->recv(buffer, source, tag_of(stage, microbatch, 0));
  }
  return pending;
}

Tensors StageLinks::wait(PendingActivations& pending) {
  if (!pending.header_work_) {
    std::vector<at::Tensor> buffer{pending.header_};
    pending.header_work_ = group_->recv(buffer, pending.source_, tag_of(pending.stage_, pending.microbatch_, 0));
  }
  wait_or_explain(*pending.header_work_, "receiving the activation header from", pending.stage_, pending.microbatch_,
                  pending.source_);
  const auto metas = decode_header(pending.header_.cpu(), pending.stage_, pending.microbatch_);
  Tensors data;
  std::vector<c10::intrusive_ptr<c10d::Work>> work;
  for (size_t i = 0; i < metas.size(); ++i) {
    std::vector<at::Tensor> buffer{at::empty(metas[i].sizes, at::TensorOptions().dtype(metas[i].dtype).device(device_))};
    data.push_back(buffer[0]);
    work.push_back(group_->recv(buffer, pending.source_, tag_of(pending.stage_, pending.microbatch_, activation_channel(i))));
  }
  for (auto& receive : work) {
    wait_or_explain(*receive, "receiving activations from", pending.stage_, pending.microbatch_, pending.source_);
  }
  return data;
}

void StageLinks::send_gradients(const Tensors& gradients, const std::vector<TensorMeta>& metas, int stage,
                                int microbatch, int destination) {
  TORCH_INTERNAL_ASSERT(gradients.size() == metas.size());
  for (size_t i = 0; i < metas.size(); ++i) {
    if (!carries_gradient(metas[i])) {
      continue;
    }
    std::vector<at::Tensor> data{
        gradients[i].defined()
            ? gradients[i].contiguous()
            : at::zeros(metas[i].sizes, at::TensorOptions().dtype(metas[i].dtype).device(device_))};
    sends_.push_back({data, group_->send(data, destination, tag_of(stage, microbatch, gradient_channel(i))),
                      "sending the gradient of stage " + std::to_string(stage) + "'s output for micro-batch " +
                          std::to_string(microbatch) + " to rank " + std::to_string(destination)});
  }
}

PendingGradients StageLinks::post_gradients(const std::vector<TensorMeta>& metas, int stage, int microbatch,
                                            int source) {
  PendingGradients pending;
  for (size_t i = 0; i < metas.size(); ++i) {
    if (!carries_gradient(metas[i])) {
      pending.data_.emplace_back();
      continue;
    }
    std::vector<at::Tensor> buffer{
        at::empty(metas[i].sizes, at::TensorOptions().dtype(metas[i].dtype).device(device_))};
    pending.data_.push_back(buffer[0]);
    pending.work_.push_back(group_->recv(buffer, source, tag_of(stage, microbatch, gradient_channel(i))));
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
      const std::string what = send.what + " failed: " + error.what();
      sends_.clear();
      TORCH_CHECK(false, "pipeline: ", what);
    }
  }
  sends_.clear();
}

} // namespace torchpar::pipeline
