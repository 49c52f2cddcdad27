// Activations forward and gradients backward between pipeline ranks, as async c10d send/recv.
//
// Every message has its own tag (stage, micro-batch, channel), so sends and receives match no matter
// in which order ranks post them; sends never block, a rank only waits where a compute action needs
// the data. Gradients need no description: they have the shapes of the activations they belong to.
//
// Activations may change shape from one micro-batch or step to the next (variable sequence length),
// yet a receive must know its size when posted, and with Gloo a payload only travels once its
// receive is posted. Both ends of a link therefore remember the shapes of the link's last transfer.
// The receiver posts the data's receives with those shapes ahead of time; every transfer also carries
// a small header with the real shapes. Unchanged (the usual case): the data arrives on the posted
// receives, no round trip on the critical path. Changed: the sender fills the posted receives with
// placeholders and sends the data again on a second channel, which the receiver posts once the
// header told it the new shapes.
#pragma once
#include <torchpar/common/c10d_fwd.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torchpar::pipeline {

using Tensors = std::vector<at::Tensor>;

// Micro-batches per step the message tags can tell apart.
constexpr int kMaxMicrobatches = 4096;

struct TensorMeta {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> sizes;
  bool operator==(const TensorMeta& other) const { return dtype == other.dtype && sizes == other.sizes; }
};
using TensorMetas = std::vector<TensorMeta>;

TensorMetas metas_of(const Tensors& tensors);
// "[8, 16] Float, [8] Long"
std::string describe(const TensorMetas& metas);
bool carries_gradient(const TensorMeta& meta);

class SameHostRings;

class PendingGradients {
 private:
  friend class StageLinks;
  int stage_ = 0, microbatch_ = 0, source_ = 0;
  Tensors data_;
  std::vector<c10::intrusive_ptr<c10d::Work>> work_;
};

class StageLinks {
 public:
  // Collective over `group` (it connects the same-host rings, same_host_rings.h, for CPU messages).
  StageLinks(c10::intrusive_ptr<c10d::ProcessGroup> group, const c10::Device& device);
  ~StageLinks();

  // `stage` is the receiving stage, `destination` its rank.
  void send_activations(const Tensors& tensors, int stage, int microbatch, int destination);
  // Posts the receives of micro-batch `microbatch`'s input of `stage` (micro-batches of a stage in
  // increasing order); waits for the previous micro-batch's header if it has not arrived yet, since
  // its shapes are the guess for this one.
  void post_activations(int stage, int microbatch, int source);
  // The blocking part of post_activations on its own, so a caller can count it as waiting.
  void wait_for_previous_header(int stage, int microbatch);
  Tensors receive_activations(int stage, int microbatch);

  // `stage` is the stage whose output the gradients belong to (the receiver); one entry per
  // activation tensor, undefined for those that carry no gradient (integer tensors).
  void send_gradients(const Tensors& gradients, const TensorMetas& metas, int stage, int microbatch,
                      int destination);
  PendingGradients post_gradients(const TensorMetas& metas, int stage, int microbatch, int source);
  Tensors wait(PendingGradients& pending);

  // Whether messages to and from `peer` go through the same-host rings.
  bool through_rings(int peer) const;

  // Sends complete in the background; waited for (and their buffers released) at the end of a step.
  void wait_sends();
  // After a failed step: forget receives that will never be completed.
  void discard_pending();

 private:
  struct Incoming {
    int source = 0;
    at::Tensor header;
    c10::intrusive_ptr<c10d::Work> header_work;
    std::optional<TensorMetas> metas;  // once the header arrived
    std::optional<TensorMetas> guess;  // shapes the data's receives were posted with
    Tensors guessed_data;
    std::vector<c10::intrusive_ptr<c10d::Work>> guessed_work;
  };
  struct Send {
    Tensors tensors;  // kept alive until sent
    c10::intrusive_ptr<c10d::Work> work;
    std::string what;
  };

  void read_header(int stage, int microbatch, Incoming& incoming);
  Tensors receive(const TensorMetas& metas, int source, int stage, int microbatch, int (*channel)(size_t),
                  std::vector<c10::intrusive_ptr<c10d::Work>>* posted);
  void send(const Tensors& tensors, int destination, int stage, int microbatch, int (*channel)(size_t),
            const std::string& what);

  // Through the shared-memory rings when the peer is a neighbour on this host, else through the group.
  c10::intrusive_ptr<c10d::Work> post_send(std::vector<at::Tensor>& data, int destination, int tag);
  c10::intrusive_ptr<c10d::Work> post_recv(std::vector<at::Tensor>& buffer, int source, int tag);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10::Device device_;
  std::unique_ptr<SameHostRings> rings_;  // null: every message through the group
  // NCCL pairs messages in posting order, not by tag: there, no activation receive is posted ahead
  // of its header (and the pipeline refuses the schedules whose two ends post in different orders).
  bool guess_shapes_;
  std::map<int, TensorMetas> last_sent_;      // per receiving stage
  std::map<int, TensorMetas> last_received_;  // per receiving stage, in header order
  std::map<std::pair<int, int>, Incoming> incoming_;
  std::vector<Send> sends_;
};

} // namespace torchpar::pipeline
