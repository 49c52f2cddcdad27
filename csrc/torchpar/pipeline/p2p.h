// Activations forward and gradients backward between pipeline ranks, as async c10d send/recv.
//
// Every message has its own tag (stage, micro-batch, tensor), so sends and receives match no matter
// in which order ranks post them; sends never block, a rank only waits where a compute action needs
// the data. Activations are preceded by a small header carrying their dtypes and shapes, read for
// every micro-batch, so shapes may change from one micro-batch or step to the next (variable sequence
// lengths). Gradients need no header: they have the shapes of the activations they belong to.
#pragma once
#include <torchpar/comm/c10d_fwd.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <string>
#include <vector>

namespace torchpar::pipeline {

using Tensors = std::vector<at::Tensor>;

struct TensorMeta {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> sizes;
  bool operator==(const TensorMeta& other) const { return dtype == other.dtype && sizes == other.sizes; }
};

std::vector<TensorMeta> metas_of(const Tensors& tensors);
// "[8, 16] float, [8] long"
std::string describe(const std::vector<TensorMeta>& metas);
bool carries_gradient(const TensorMeta& meta);

class PendingActivations {
 public:
 private:
  friend class StageLinks;
  int stage_ = 0, microbatch_ = 0, source_ = 0;
  at::Tensor header_;
  c10::intrusive_ptr<c10d::Work> header_work_;
};

class PendingGradients {
 private:
  friend class StageLinks;
  int stage_ = 0, microbatch_ = 0, source_ = 0;
  Tensors data_;
  std::vector<c10::intrusive_ptr<c10d::Work>> work_;
};

class StageLinks {
 public:
  StageLinks(c10::intrusive_ptr<c10d::ProcessGroup> group, const c10::Device& device);

  // `stage` is the receiving stage, `destination` its rank.
  void send_activations(const Tensors& tensors, int stage, int microbatch, int destination);
  // Posts the receive of the header, which then arrives while this rank computes; the data's
  // receives are posted by wait, once the header told their shapes.
  PendingActivations post_activations(int stage, int microbatch, int source);
  Tensors wait(PendingActivations& pending);

  // `stage` is the stage whose output the gradients belong to (the receiver); one entry per
  // activation tensor, undefined for those that carry no gradient (integer tensors).
  void send_gradients(const Tensors& gradients, const std::vector<TensorMeta>& metas, int stage, int microbatch,
                      int destination);
  PendingGradients post_gradients(const std::vector<TensorMeta>& metas, int stage, int microbatch, int source);
  Tensors wait(PendingGradients& pending);

  // Sends complete in the background; waited for (and their buffers released) at the end of a step.
  void wait_sends();

  c10d::ProcessGroup& group() { return *group_; }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10::Device device_;
  struct Send {
    Tensors tensors;  // kept alive until sent
    c10::intrusive_ptr<c10d::Work> work;
    std::string what;
  };
  std::vector<Send> sends_;
};

} // namespace torchpar::pipeline
