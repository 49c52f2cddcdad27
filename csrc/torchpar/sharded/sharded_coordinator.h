// The engine of sharded data parallelism (ZeRO stages 1 and 2): each rank holds the whole model, but its
// optimizer steps only its shard of the trained parameters (shard_layout.h), so the optimizer state (and
// at stage 2 the averaged gradients) take 1/N of the memory. During backward, each gradient bucket is
// reduce-scattered the moment its last gradient is produced, so communication overlaps backward; after the
// optimizer's step the updated shards are all-gathered back into every rank's parameters. The bytes moved
// per step are DDP's (a reduce-scatter and an all-gather instead of an all-reduce).
#pragma once
#include <torchpar/common/c10d_fwd.h>
#include <torchpar/common/peer_processes.h>
#include <torchpar/common/replica_check.h>
#include <torchpar/sharded/options.h>
#include <torchpar/sharded/shard_layout.h>

#include <ATen/core/Tensor.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace c10d {
class Work;
} // namespace c10d

namespace torchpar {
class GradientReadyHooks;
} // namespace torchpar

namespace torchpar::sharded {

class ShardedCoordinator {
 public:
  // Collective: every rank of the group constructs it with the same model; rank 0's values are copied to
  // every rank. A parameter listed twice (tied weights) counts once; frozen parameters stay replicated.
  ShardedCoordinator(NamedTensors parameters, NamedTensors buffers, ShardedOptions options);
  ~ShardedCoordinator();
  ShardedCoordinator(const ShardedCoordinator&) = delete;
  ShardedCoordinator& operator=(const ShardedCoordinator&) = delete;

  // This rank's shard of the trained parameters, one flat tensor per dtype: what its optimizer steps.
  // After a synchronised backward each one's .grad is this rank's part of the gradient averaged over the
  // group (added to what was there, as .grad accumulates).
  const std::vector<at::Tensor>& shard() const { return shard_; }
  const ShardLayout& layout() const { return layout_; }
  int rank() const;  // this rank's, in the group the shards are cut over
  int stage() const { return options_.stage(); }

  bool grad_sync() const { return grad_sync_; }
  void set_grad_sync(bool enabled) { grad_sync_ = enabled; }
  // Whether the coming forward's backward will be synchronised: grad mode on and grad_sync.
  bool will_sync() const;
  // Before each forward: buffers from rank 0 (when synchronising), and the gradient hooks armed or not.
  void pre_forward(bool will_sync);
  // Stages 1-2: the gradients accumulated in the parameters by backward passes run outside the wrapper's forward
  // (a pipeline stage's micro-batches, say) reduce-scattered into the shard's gradient now, bucket by bucket, as
  // a synchronised backward does while it runs. Collective.
  void reduce_gradients();
  // After the optimizer stepped shard(): every rank's pieces all-gathered into the parameters.
  void gather_parameters();
  // The gradient norm over every rank's shard (as torch::nn::utils::clip_grad_norm_ over the whole model's
  // averaged gradients), and the shards' gradients scaled to at most `max_norm`. Collective.
  double clip_grad_norm(double max_norm, double norm_type = 2.0);
  // Releases the parameters' own gradients (stage 1 keeps the local ones until here).
  void zero_parameter_gradients();

  // The trained parameters' names (the first name of a tied one), indexed as the layout's parameters.
  const std::vector<std::string>& parameter_names() const { return names_; }
  // A tensor shaped like shard()[shard] (its values, its gradient, an optimizer's state on it) made whole:
  // every rank's pieces gathered, cut per parameter and shaped like it, as (parameter index, tensor) for each
  // parameter of that shard's dtype. Collective. What a checkpoint that any group size can load keeps.
  std::vector<std::pair<size_t, at::Tensor>> gather_full(size_t shard, const at::Tensor& shard_like) const;
  // The inverse: this rank's shard-shaped tensor cut out of whole per-parameter tensors (`full[i]` for
  // parameter i; only the parameters of that shard's dtype are read), padding zero. Local.
  at::Tensor shard_of(size_t shard, const std::vector<at::Tensor>& full) const;

  // Stage 3. Unit 0 is the root (what no unit holds); unit k + 1 is ShardedOptions::units()[k]. Called by the
  // module wrappers around each unit's forward (Python's forward hooks) and before its backward (a hook on its
  // outputs' gradients). Gathering is collective over the group: every rank runs the same units in order.
  int unit_count() const { return units_; }
  void before_unit_forward(int unit);
  void after_unit_forward(int unit);
  void before_unit_backward(int unit);
  // For the C++ wrappers, which have no backward hooks on modules: a hook on `output`, the unit's forward output,
  // that calls before_unit_backward when its gradient arrives (nothing where it needs none).
  void gather_before_backward_of(int unit, at::Tensor& output);
  // Stage 3's unit names (ShardedOptions::units, as given or defaulted by the wrapper).
  const std::vector<std::string>& unit_names() const { return options_.units(); }
  // The unit of trained parameter `parameter` as errors name it ("unit 'layers.0'", "the root unit"), and
  // whether its values are there now (stages 1-2: always).
  std::string unit_of(size_t parameter) const;
  bool parameter_gathered(size_t parameter) const;
  // Every unit gathered (to read or save the whole model), and released again.
  void gather_all();
  void release_all();

  // Bytes this rank sent in the last step's reduce-scatters and all-gathers (ring algorithm's count).
  int64_t bytes_sent_last_step() const { return bytes_sent_; }

 private:
  void on_gradient_ready(size_t index);
  void launch_ready_buckets();
  void launch(size_t bucket);
  void complete_oldest();  // waits for the oldest reduce-scatter, adds its piece into the shard's gradient
  void finish_backward();
  // What a bucket of master dtype `dtype` is reduced and gathered in, under the mixed-precision options.
  c10::ScalarType reduce_dtype(c10::ScalarType dtype) const;
  c10::ScalarType compute_dtype(c10::ScalarType dtype) const;
  // An all-gather in flight, and the piece it sends (which must live until it completes).
  struct Gathering {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor piece;
  };
  // Every rank's piece of `bucket` in `shard_like` (shaped like its shard) into `gathered` (the bucket's padded
  // length, in its dtype: the piece is cast to it). Collective.
  Gathering launch_all_gather(const ShardBucket& bucket, const at::Tensor& shard_like, at::Tensor& gathered) const;
  // The same, waited for. Returns the bytes this rank sent.
  int64_t all_gather_bucket(const ShardBucket& bucket, const at::Tensor& shard_like, at::Tensor& gathered) const;
  int64_t gathered_bytes(const ShardBucket& bucket, const at::Tensor& piece) const;
  // Stage 3: a bucket's parameters, views of one flat tensor whose storage is allocated and filled by an
  // all-gather (started, then finished: waited for), or freed (every view, autograd's saved ones included, then
  // holds no memory).
  void start_gather(size_t bucket);
  void finish_gather(size_t bucket);
  void gather_bucket(size_t bucket);
  void release_bucket(size_t bucket);
  // Stage 3: `unit`'s gather started, to run while the current unit computes (no-op for the root or past the
  // last unit, or when ShardedOptions::prefetch is off).
  void prefetch(int unit);
  // "unit 'layers.0'", "the root unit", or the bucket's parameters: what an error names.
  std::string describe(const ShardBucket& bucket) const;
  // Waits for `work`; its failure is rethrown naming this rank, `what` and any rank whose process is gone.
  void wait_naming_lost(c10d::Work& work, const std::string& what) const;
  void for_buckets_of(int unit, void (ShardedCoordinator::*action)(size_t));

  PeerProcesses peers_;  // to name the rank that died when a collective fails
  std::vector<at::Tensor> parameters_;  // trained, distinct
  std::vector<std::string> names_;
  NamedTensors buffers_;
  ShardedOptions options_;
  ShardLayout layout_;
  std::vector<at::Tensor> shard_;
  int units_ = 1;
  bool prefetch_ = false;  // ShardedOptions::prefetch, resolved for the parameters' device
  std::vector<at::Tensor> unsharded_;  // per bucket, the flat tensor its parameters view (stage 3: when gathered)
  std::vector<bool> gathered_;                      // its storage allocated (its all-gather perhaps in flight)
  std::vector<std::optional<Gathering>> gathering_;  // its all-gather in flight
  std::unique_ptr<GradientReadyHooks> hooks_;
  std::mutex mutex_;
  bool grad_sync_ = true;
  bool armed_ = false;
  bool backward_started_ = false;
  std::vector<bool> ready_;
  std::vector<size_t> pending_;  // per bucket: gradients still to come
  size_t next_bucket_ = 0;
  struct InFlight {
    size_t bucket;
    at::Tensor input;   // the bucket's gradients, flat and padded
    at::Tensor output;  // this rank's piece of their sum
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::vector<InFlight> in_flight_;
  int64_t bytes_sent_ = 0;
};

// `options` with its group swapped, for CPU `parameters` on a Gloo group whose ranks share this host, for an shm group
// over the same ranks (comm::shm_group_beside), as Python's wrapper does: Gloo's reduce-scatter clones its input and
// all-reduces the clone. Collective over the group.
ShardedOptions through_same_host_group(ShardedOptions options, const std::vector<at::Tensor>& parameters);

} // namespace torchpar::sharded
