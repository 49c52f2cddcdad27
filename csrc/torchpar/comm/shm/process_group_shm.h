#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <torchpar/comm/shm/communicator.h>
#include <torchpar/comm/shm/host_layout.h>
#include <torchpar/comm/shm/shm_work.h>

namespace torchpar::comm::shm {

// torchpar's c10d backend for CPU tensors: collectives through a shared-memory segment among the
// ranks of a host instead of loopback TCP. Registered as "shm" (C++ init_process_group, and
// torch.distributed once `import torchpar` ran). With ranks on several hosts, allreduce,
// broadcast, reduce, allgather and barrier run hierarchically (shared memory within each host,
// Gloo between one leader per host) and the other collectives go to Gloo; point-to-point ops
// (send/recv) always go through a Gloo backend kept beside the segment.
class ProcessGroupShm : public c10d::Backend {
 public:
  ProcessGroupShm(
      const c10::intrusive_ptr<c10d::Store>& store,
      int rank,
      int size,
      std::chrono::milliseconds timeout);
  ~ProcessGroupShm() override;

  // Every rank of the group on this host: ops go through the shared segment alone.
  bool single_host() const {
    return hosts_.host_count() == 1;
  }
  const std::string getBackendName() const override {
    return "shm";
  }
  void setTimeout(std::chrono::milliseconds timeout) override;
  // What an op waits for a peer at most (for torchpar's own transports beside this group).
  std::chrono::milliseconds timeout() const {
    return communicator_.timeout();
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
      std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // Gloo's monitored barrier on the Gloo backend kept beside the segment: rank 0 names every rank
  // that did not arrive within the timeout.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  // Collectives issued on this group so far, the same on every rank while the ranks agree (torch's
  // TORCH_DISTRIBUTED_DEBUG=DETAIL checks and object collectives ask for it).
  uint64_t getSequenceNumberForGroup() override {
    return collectives_issued_.load();
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  using Task = std::function<void()>;
  // Runs `task` on the backend's thread, in call order; a task up to a few MiB finding nothing ahead
  // of it runs at once on the calling thread instead (two thread hand-offs would cost more than the
  // overlap gains).
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, std::vector<at::Tensor> outputs, uint64_t bytes,
                                         Task task);
  // Multi-host fallback: `call` runs the op on Gloo, from this backend's queue, so that it keeps
  // its place among the shm ops issued before and after it.
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> via_gloo(c10d::OpType type, std::vector<at::Tensor> outputs, Call call) {
    return enqueue(type, std::move(outputs), kAlwaysQueued, [this, call]() mutable { call(*gloo_)->wait(); });
  }
  static constexpr uint64_t kAlwaysQueued = ~uint64_t{0};
  void run_tasks();
  // The op bodies, on contiguous buffers, single-host or hierarchical.
  void allreduce_buffer(const at::Tensor& buffer, c10d::ReduceOp::RedOpType op);
  void broadcast_buffer(const at::Tensor& buffer, int64_t root);
  void reduce_buffer(const at::Tensor& buffer, int64_t root, c10d::ReduceOp::RedOpType op);
  void barrier_all();
  // Within this host: local rank `local_root` sends `buffer`; every other local rank receives it,
  // or only `only_to` when given.
  void host_broadcast(const at::Tensor& buffer, int local_root, int only_to = -1);
  // alltoall_base on flat row-major buffers; splits are in rows of `row_bytes`.
  void exchange_all_to_all(const at::Tensor& output, const at::Tensor& input, std::vector<int64_t> output_splits,
                           std::vector<int64_t> input_splits, int64_t row_bytes);
  void all_gather_into(const at::Tensor& output, const at::Tensor& input);

  HostLayout hosts_;
  Communicator communicator_; // the ranks of this host
  c10::intrusive_ptr<c10d::Backend> gloo_; // every rank: point-to-point, and multi-host fallbacks
  c10::intrusive_ptr<c10d::Backend> leaders_; // one rank per host, on the host leaders only

  std::mutex mutex_;
  std::condition_variable wake_;
  using QueuedTask = std::pair<c10::intrusive_ptr<ShmWork>, Task>;
  std::deque<QueuedTask> queue_;
  // Tasks the backend's thread ran, released by the next caller, a waiter or the destructor (shm_work.h).
  std::shared_ptr<FinishedTasks> finished_ = std::make_shared<FinishedTasks>();
  bool stopping_ = false;
  bool running_ = false; // a task is executing, on the backend's thread or a caller's
  std::thread worker_;
  std::atomic<uint64_t> collectives_issued_{0};
};

// The backend, for torchpar's backend factory and for torch.distributed's registration.
c10::intrusive_ptr<c10d::Backend> make_shm_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout);

} // namespace torchpar::comm::shm
