// Everything DistributedDataParallel does around the wrapped module's forward, independent of how the
// module is written (a LibTorch C++ module or a Python nn.Module): checks at construction that every
// rank holds the same parameters and copies rank 0's values; per forward broadcasts buffers and arms
// the Reducer; no_sync; and join, which lets ranks that ran out of data shadow the others' collectives.
#pragma once
#include <torchpar/common/peer_processes.h>
#include <torchpar/common/replica_check.h>
#include <torchpar/ddp/options.h>

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace c10d {
class CommHookInterface;
} // namespace c10d

namespace torchpar::ddp {

class Reducer;
class Timeline;

using NamedTensors = torchpar::NamedTensors;

class ReplicaCoordinator {
 public:
  // Collective: every rank of the group must construct it with its replica's tensors.
  ReplicaCoordinator(NamedTensors parameters, NamedTensors buffers, DistributedDataParallelOptions options);
  ~ReplicaCoordinator();

  // Whether the coming forward's backward will all-reduce gradients: grad mode on and sync enabled.
  bool will_sync() const;
  // Around the wrapped module's forward; `outputs` are the tensors the forward returned.
  void pre_forward(bool will_sync);
  void post_forward(const std::vector<at::Tensor>& outputs, bool will_sync);

  // no_sync: while false, backward accumulates gradients locally and communicates nothing.
  void set_grad_sync(bool enabled) { grad_sync_ = enabled; }
  bool grad_sync() const { return grad_sync_; }

  // Uneven inputs. Between begin_join() and finish_join() each forward also tells the others that this
  // rank is still active. finish_join() (called when this rank's data is exhausted) shadows the
  // collectives of the ranks still training until all have finished, then copies the parameters and
  // buffers of the rank that trained longest to every rank. Collective. Gradients are divided by the
  // initial world size, or with divide_by_initial_world_size false by the ranks still training.
  void begin_join(bool divide_by_initial_world_size = true);
  void finish_join();
  // The training loop raised: leave join mode without shadowing (the others will time out).
  void cancel_join();
  bool joining() const { return join_enabled_; }
  // finish_join's two parts, for torch's generic Join context manager, which runs its own loop:
  // the active ranks' collectives of one iteration, shadowed (false when no rank was active), and,
  // once every rank is done, the final copy of the model. Both collective.
  bool shadow_iteration();
  void synchronise_final_model();

  // static_graph, set after construction (torch's _set_static_graph); before the first backward.
  void set_static_graph();

  void register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook);
  Reducer& reducer() { return *reducer_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return options_.process_group(); }
  // The group a built-in communication hook given `requested` all-reduces over: the data group when
  // `requested` is null or the process group (the same ranks), else `requested`.
  c10::intrusive_ptr<c10d::ProcessGroup> comm_hook_group(c10::intrusive_ptr<c10d::ProcessGroup> requested) const;
  const std::shared_ptr<Timeline>& timeline() const { return timeline_; }

 private:
  void verify_replicas_match() const;
  // pre_forward's collectives: join status, bucket rebuild, buffers.
  void synchronise_before_forward(bool will_sync);
  at::Device device() const;
  void broadcast_state(int source_rank, bool include_parameters, bool include_buffers = true);
  struct JoinStatus {
    std::vector<int> active_ranks;
    bool syncing_gradients = false;
    bool broadcasting_buffers = false;
  };
  // One all-reduce telling every rank, joined or not, what the active ranks do this iteration.
  JoinStatus exchange_join_status(bool active, bool will_sync, bool will_broadcast_buffers);

  NamedTensors parameters_;
  NamedTensors buffers_;
  DistributedDataParallelOptions options_;
  PeerProcesses peers_;  // gathered with the construction check: names the rank that died in errors
  std::shared_ptr<Timeline> timeline_;
  std::unique_ptr<Reducer> reducer_;
  bool grad_sync_ = true;
  bool join_enabled_ = false;
  bool divide_by_initial_world_size_ = true;
  int64_t joined_forwards_ = 0;
  // As torch: buffers are broadcast before a forward only if the previous forward synchronised.
  bool sync_buffers_next_forward_ = true;
  std::chrono::system_clock::time_point forward_began_at_;
};

} // namespace torchpar::ddp
