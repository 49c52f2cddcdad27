// The gradient reducer behind DistributedDataParallel: packs gradients into flat buckets and
// all-reduces each bucket asynchronously the moment its last gradient is produced, so that
// communication overlaps the rest of backward; at the end of backward it waits for every bucket and
// writes the averaged gradients back to the parameters (or leaves them as views of the buckets).
#pragma once
#include <torchpar/common/c10d_fwd.h>
#include <torchpar/common/peer_processes.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace c10d {
class CommHookInterface;
class GradBucket;
} // namespace c10d


namespace torchpar {
class GradientReadyHooks;
} // namespace torchpar

namespace torchpar::ddp {

class Timeline;

struct ReducerOptions {
  // Bucket k's byte cap, the last entry serving every later bucket (see assign_buckets).
  std::vector<size_t> bucket_caps_bytes = {1u << 20, 25u << 20};
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool static_graph = false;
  // Carries the buckets' all-reduces: the process group itself, or a group of the same ranks beside it
  // (DistributedDataParallelOptions::data_process_group).
  c10::intrusive_ptr<c10d::ProcessGroup> data_process_group;
};

class Reducer {
 public:
  Reducer(
      std::vector<at::Tensor> parameters,
      std::vector<std::string> names,
      c10::intrusive_ptr<c10d::ProcessGroup> process_group,
      ReducerOptions options,
      std::shared_ptr<Timeline> timeline = nullptr,
      PeerProcesses peers = {});
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Called before a forward whose backward will synchronise: rebuilds the buckets once from the
  // gradient order observed in the first iteration (rank 0's order, broadcast, so every rank agrees).
  // Collective when it rebuilds. Returns whether it rebuilt.
  bool rebuild_buckets_if_due();

  // Called after such a forward with its outputs: arms the gradient hooks for the coming backward and,
  // with find_unused_parameters, finds the parameters the outputs do not depend on.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);

  // Called after every forward: moves the hook of a parameter whose gradient accumulator autograd
  // replaced to the new one. Replacing a parameter's storage with set_ (LibTorch's Module::load does,
  // to load a checkpoint) makes autograd drop the accumulator the hook sits on; without this, that
  // parameter's gradient would silently stop being averaged and the replicas would drift apart.
  void follow_replaced_grad_accumulators();

  // What a rank that has run out of data does while others still train (join): the same collectives
  // as one synchronised backward, contributing zero gradients, without touching its own gradients.
  void shadow_backward();

  // Replaces the default all-reduce (sum, then divide by the world size) by a hook that receives each
  // bucket and returns a future holding the bucket's reduced contents (torch's register_comm_hook).
  // The hook sees raw local gradients: averaging is its job. At most once, before the first backward.
  void register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook);

  // Gradients are averaged by dividing by `divisor` (the world size, unless join says otherwise).
  void set_gradient_divisor(int divisor);
  // static_graph after construction; before the first synchronised backward.
  void set_static_graph();

  // Buckets in all-reduce order, as parameter indices (for tests and logging).
  std::vector<std::vector<size_t>> bucket_indices() const;
  bool buckets_rebuilt() const { return buckets_rebuilt_; }
  // Whether gradients are averaged where they lie, by an allreduce_coalesced (AVG) of the tensors
  // autograd made, instead of copied into the bucket, all-reduced and copied back: on an shm data
  // group, without a comm hook or gradient_as_bucket_view, while gradients are divided by the world size.
  bool reducing_in_place() const;
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return process_group_; }

 private:
  struct Bucket {
    std::vector<size_t> parameter_indices;
    at::Tensor flat;                      // all gradients of the bucket, one dtype, one device
    std::vector<at::Tensor> views;        // per parameter: its slice of `flat`, shaped like it
    // What an all-reduce in place reduces, per parameter: its gradient itself, or its view when the
    // gradient could not be (undefined, strided, requiring grad); and which of them were gradients.
    std::vector<at::Tensor> inputs;
    std::vector<bool> reduced_in_gradient;
    std::vector<size_t> offsets, lengths;
    std::vector<std::vector<int64_t>> sizes;
    size_t pending = 0;                   // gradients still to come this iteration
    c10::intrusive_ptr<c10::ivalue::Future> future;
    std::chrono::system_clock::time_point launched_at;
  };
  struct Location {
    size_t bucket = 0;
    size_t slot = 0;
  };

  void build_buckets(const std::vector<size_t>& order);
  void on_gradient_accumulated(size_t index);
  void mark_ready(size_t index, bool produced_by_autograd);
  // Counts one more gradient of the bucket in; launches the buckets that are ready once it is full.
  void launch_if_full(size_t bucket_index);
  void launch_ready_buckets();
  // Starts the bucket's all-reduce (or the comm hook) on `buffer`: the bucket itself, or zeros.
  c10::intrusive_ptr<c10::ivalue::Future> communicate(size_t bucket_index, at::Tensor buffer);
  // Starts the all-reduce in place of `tensors` (the bucket's inputs, or zeros of its size).
  c10::intrusive_ptr<c10::ivalue::Future> reduce_in_place(size_t bucket_index, std::vector<at::Tensor> tensors);
  // Records the all-reduce's span on the timeline (if any) once `future` completes.
  c10::intrusive_ptr<c10::ivalue::Future> traced(size_t bucket_index, std::chrono::system_clock::time_point launched_at,
                                                 c10::intrusive_ptr<c10::ivalue::Future> future);
  // Waits; returns the hook's result tensor (undefined for the in-place default all-reduce).
  at::Tensor reduced_result(size_t bucket_index, const c10::intrusive_ptr<c10::ivalue::Future>& future);
  void finalize_backward();
  // Waits for every launched bucket; returns the first failure's message ("" if none).
  std::string wait_for_buckets();
  // Sums per-parameter use flags over ranks; true where some rank produced a gradient.
  at::Tensor all_reduce_used_map(at::Tensor used);
  void write_back_gradients(const at::Tensor& globally_used);
  bool needs_used_map() const;
  std::vector<size_t> unreachable_parameters(const std::vector<at::Tensor>& outputs) const;
  std::string describe(const std::vector<size_t>& indices) const;
  int rank() const;
  int world_size() const;
  // Where the replica lives, hence where collectives' control tensors must be (NCCL takes no CPU tensors).
  at::Device device() const;

  std::vector<at::Tensor> parameters_;
  std::vector<std::string> names_;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  ReducerOptions options_;
  std::shared_ptr<Timeline> timeline_;
  PeerProcesses peers_;  // to name the rank that died when a bucket's all-reduce fails
  std::unique_ptr<c10d::CommHookInterface> comm_hook_;
  at::Tensor average_scale_;  // 1 / world size, a wrapped scalar as torch's reducer multiplies by
  int divisor_;               // what gradients are divided by: the world size, unless join says otherwise
  bool in_place_capable_;     // the data group reduces coalesced tensors where they lie (shm)

  std::vector<Bucket> buckets_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;  // each bucket's op in flight, waited on in reduced_result
  std::vector<Location> locations_;
  std::mutex mutex_;  // autograd hooks, the final callback and the caller's thread

  // Per-iteration state (reset by prepare_for_backward).
  bool armed_ = false;               // a synchronised backward is expected
  bool backward_started_ = false;
  std::vector<bool> ready_;
  std::vector<size_t> unused_;       // marked ready at the first hook, no gradient of their own
  at::Tensor locally_used_;          // int32 per parameter: autograd produced its gradient (no_sync too)
  size_t next_bucket_to_launch_ = 0;
  std::chrono::system_clock::time_point backward_began_at_;

  // Learnt over iterations.
  size_t iteration_ = 0;             // completed synchronised backwards
  std::vector<size_t> observed_order_;
  bool buckets_rebuilt_ = false;
  std::vector<size_t> static_unused_;         // static_graph: locally unused, learnt in iteration 1
  at::Tensor static_globally_used_;           // static_graph: used by some rank, learnt in iteration 1

  // Last: its hooks call into the members above, so it is destroyed first.
  std::unique_ptr<GradientReadyHooks> gradient_hooks_;
};

} // namespace torchpar::ddp
