#include <torchpar/comm/shm/process_group_shm.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <iomanip>
#include <random>
#include <sstream>
#include <thread>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <torchpar/comm/gloo_backend.h>
#include <torchpar/comm/shm/reduce_kernels.h>
#include <torchpar/common/flat_buffers.h>

namespace torchpar::comm::shm {
namespace {

// Ops up to this size may run on the calling thread (see enqueue). Handing an op to the backend's
// thread and waking the caller again cost ~100 µs on a 2-core VM, as much as a 512 KiB all-reduce:
// from 4 MiB (~1 ms) on it is under a tenth of the op, and the caller gains the overlap.
constexpr uint64_t kInlineBytes = 4 << 20;

using RedOp = c10d::ReduceOp::RedOpType;

std::string random_token() {
  std::random_device random;
  std::ostringstream text;
  for (int i = 0; i < 4; ++i) {
    text << std::hex << std::setw(8) << std::setfill('0') << random();
  }
  return text.str();
}

// The host's first rank (its leader) creates the segment under a fresh random name and publishes
// the name through the store; the other ranks of the host map it and report so.
SharedSegment rendezvous(const c10::intrusive_ptr<c10d::Store>& store, const HostLayout& hosts,
                         const SegmentLayout& layout, std::chrono::milliseconds timeout) {
  const std::string prefix = "shm/host" + std::to_string(hosts.host) + "/";
  if (!hosts.leader()) {
    const auto value = store->get(prefix + "segment");
    auto segment = SharedSegment::open(std::string(value.begin(), value.end()), layout.total_bytes());
    store->add(prefix + "mapped", 1);
    return segment;
  }
  // The leader removes the name once every rank of the host has mapped the segment, or when they
  // do not within the timeout, or on any error: whatever happens, the name does not outlive this.
  const std::string name = "/torchpar-" + std::to_string(::getuid()) + "-" + random_token();
  auto segment = SharedSegment::create(name, layout.total_bytes());
  try {
    store->set(prefix + "segment", std::vector<uint8_t>(name.begin(), name.end()));
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int64_t mapped = 0;
    while ((mapped = store->add(prefix + "mapped", 0)) < layout.world - 1) {
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "shm backend: only ", mapped + 1, " of ",
                  layout.world, " ranks on this host mapped the shared segment within the timeout");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  } catch (...) {
    SharedSegment::unlink(name);
    throw;
  }
  SharedSegment::unlink(name);
  return segment;
}

void check_cpu_dense(const at::Tensor& tensor, const char* op) {
  TORCH_CHECK(tensor.device().is_cpu(), "shm backend: ", op, " needs CPU tensors, got one on ", tensor.device(),
              " (use 'cpu:shm,cuda:nccl' to send CUDA tensors to NCCL)");
  TORCH_CHECK(tensor.layout() == c10::kStrided, "shm backend: ", op, " does not support sparse tensors");
}

const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "shm backend: ", op, " takes exactly one tensor per rank, got ", tensors.size());
  check_cpu_dense(tensors[0], op);
  return tensors[0];
}

void check_root(int64_t root, int size, const char* op) {
  TORCH_CHECK(root >= 0 && root < size, "shm backend: ", op, " root ", root, " is not a rank of this group");
}

// The shape, as Gloo checks it: a tensor of the same element count in another shape would receive
// the elements in another layout.
void check_same(const at::Tensor& tensor, const at::Tensor& reference, const char* op, const char* what) {
  check_cpu_dense(tensor, op);
  TORCH_CHECK(tensor.scalar_type() == reference.scalar_type() && tensor.sizes() == reference.sizes(),
              "shm backend: ", op, ": every ", what, " must have the input's dtype and shape (",
              reference.scalar_type(), " ", reference.sizes(), "), got ", tensor.scalar_type(), " ", tensor.sizes());
}

// A contiguous stand-in for a user tensor that may not be contiguous: ops write into `buffer`,
// then deliver() copies it back when it is not the user's tensor itself.
struct Landing {
  explicit Landing(const at::Tensor& user_tensor)
      : user(user_tensor), buffer(user_tensor.is_contiguous() ? user_tensor : user_tensor.contiguous()) {}
  char* data() const {
    return static_cast<char*>(buffer.data_ptr());
  }
  void deliver() const {
    if (!buffer.is_same(user)) {
      user.copy_(buffer);
    }
  }
  at::Tensor user;
  at::Tensor buffer;
};

uint64_t bytes_of(const at::Tensor& tensor) {
  return static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
}

// The bytes of tensors of any dtypes and shapes, one after another.
at::Tensor byte_concatenation(const std::vector<at::Tensor>& tensors) {
  uint64_t total = 0;
  for (const auto& tensor : tensors) {
    total += bytes_of(tensor);
  }
  at::Tensor packed = at::empty({static_cast<int64_t>(total)}, at::TensorOptions().dtype(at::kByte));
  char* cursor = static_cast<char*>(packed.data_ptr());
  for (const auto& tensor : tensors) {
    const at::Tensor source = tensor.contiguous();
    std::memcpy(cursor, source.const_data_ptr(), bytes_of(source));
    cursor += bytes_of(source);
  }
  return packed;
}

uint64_t total_bytes(const std::vector<at::Tensor>& tensors) {
  uint64_t total = 0;
  for (const auto& tensor : tensors) {
    total += bytes_of(tensor);
  }
  return total;
}

// Whether the tensors can be reduced in place where they lie: each contiguous, no two sharing bytes.
bool contiguous_and_apart(const std::vector<at::Tensor>& tensors) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const auto& tensor : tensors) {
    if (!tensor.is_contiguous()) {
      return false;
    }
    const auto begin = reinterpret_cast<uintptr_t>(tensor.const_data_ptr());
    spans.emplace_back(begin, begin + bytes_of(tensor));
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) {
      return false;
    }
  }
  return true;
}

OpDescriptor descriptor(OpKind kind, const at::Tensor& tensor, uint64_t agreed_bytes, int64_t root = -1,
                        RedOp op = RedOp::SUM) {
  OpDescriptor d{};
  d.op = static_cast<uint32_t>(kind);
  d.dtype = static_cast<int32_t>(tensor.scalar_type());
  d.root = root;
  d.reduce_op = static_cast<uint32_t>(op);
  d.agreed_bytes = agreed_bytes;
  return d;
}

std::exception_ptr run_task(const std::function<void()>& task) noexcept {
  try {
    task();
    return nullptr;
  } catch (...) {
    return std::current_exception();
  }
}

// Completing a Work runs the callbacks chained on its future, which may issue further ops on this
// backend: so it happens only once the backend is free again.
void deliver(ShmWork& work, const std::exception_ptr& error) {
  if (error) {
    work.fail(error);
  } else {
    work.complete();
  }
}

} // namespace

ProcessGroupShm::ProcessGroupShm(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout)
    : Backend(rank, size),
      hosts_(discover_hosts(store, rank, size)),
      communicator_(
          rendezvous(store, hosts_, SegmentLayout{static_cast<int>(hosts_.local_ranks().size()), kChunkBytes},
                     timeout),
          SegmentLayout{static_cast<int>(hosts_.local_ranks().size()), kChunkBytes}, hosts_.local_rank(), timeout),
      gloo_(make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>("gloo/", store), rank, size, timeout)),
      leaders_(hosts_.host_count() > 1 && hosts_.leader()
                   ? make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>("leaders/", store), hosts_.host,
                                       hosts_.host_count(), timeout)
                   : nullptr),
      worker_([this] { run_tasks(); }) {}

ProcessGroupShm::~ProcessGroupShm() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  worker_.join();
}

void ProcessGroupShm::setTimeout(std::chrono::milliseconds timeout) {
  communicator_.set_timeout(timeout);
  gloo_->setTimeout(timeout);
  if (leaders_) {
    leaders_->setTimeout(timeout);
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::enqueue(
    c10d::OpType type,
    std::vector<at::Tensor> outputs,
    uint64_t bytes,
    Task task) {
  auto work = c10::make_intrusive<ShmWork>(rank_, type, ++collectives_issued_, std::move(outputs), finished_);
  finished_->release();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (bytes > kInlineBytes || running_ || !queue_.empty()) {
      queue_.emplace_back(work, std::move(task));
      lock.unlock();
      wake_.notify_one();
      return work;
    }
    running_ = true;
  }
  const auto error = run_task(task);
  bool queued_meanwhile = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = false;
    queued_meanwhile = !queue_.empty() || stopping_;
  }
  // Only then is the backend's thread waiting for this op: waking it after every op costs the caller a
  // futex call and puts the idle thread on a core beside the ranks (measured: 1 KiB all-reduce).
  if (queued_meanwhile) {
    wake_.notify_one();
  }
  deliver(*work, error);
  return work;
}

void ProcessGroupShm::run_tasks() {
  while (true) {
    QueuedTask next;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return (stopping_ || !queue_.empty()) && !running_; });
      if (queue_.empty()) {
        return;
      }
      next = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    const auto error = run_task(next.second);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      running_ = false;
    }
    finished_->add(std::move(next.second));  // before completion: a waiter woken by it releases the task
    deliver(*next.first, error);
  }
}

void ProcessGroupShm::host_broadcast(const at::Tensor& buffer, int local_root, int only_to) {
  const uint64_t bytes = bytes_of(buffer);
  const int me = communicator_.rank();
  std::vector<Want> wants;
  if (me != local_root && (only_to < 0 || me == only_to)) {
    wants.push_back({local_root, 0, bytes, static_cast<char*>(buffer.data_ptr())});
  }
  communicator_.exchange(descriptor(OpKind::Broadcast, buffer, bytes, local_root),
                         static_cast<const char*>(buffer.const_data_ptr()), me == local_root ? bytes : 0, wants);
}

void ProcessGroupShm::allreduce_buffer(const at::Tensor& buffer, RedOp op) {
  if (single_host()) {
    communicator_.reduce(descriptor(OpKind::Allreduce, buffer, bytes_of(buffer), -1, op), buffer, buffer,
                         ReduceMode::All, op);
    return;
  }
  // Reduce to each host's leader, allreduce among leaders, broadcast back within each host.
  const RedOp step = op == RedOp::AVG ? RedOp::SUM : op;
  communicator_.reduce(descriptor(OpKind::Reduce, buffer, bytes_of(buffer), 0, step), buffer, buffer,
                       ReduceMode::Root, step);
  if (leaders_) {
    std::vector<at::Tensor> tensors{buffer};
    leaders_->allreduce(tensors, c10d::AllreduceOptions{c10d::ReduceOp(step)})->wait();
  }
  host_broadcast(buffer, 0);
  if (op == RedOp::AVG) {
    divide_by_count(buffer, size_);
  }
}

void ProcessGroupShm::broadcast_buffer(const at::Tensor& buffer, int64_t root) {
  if (single_host()) {
    host_broadcast(buffer, static_cast<int>(root));
    return;
  }
  const int root_host = hosts_.host_of_rank[root];
  if (hosts_.host == root_host) {
    host_broadcast(buffer, hosts_.local_index_of(static_cast<int>(root)));
  }
  if (leaders_) {
    std::vector<at::Tensor> tensors{buffer};
    c10d::BroadcastOptions options;
    options.rootRank = root_host;
    leaders_->broadcast(tensors, options)->wait();
  }
  if (hosts_.host != root_host) {
    host_broadcast(buffer, 0);
  }
}

void ProcessGroupShm::reduce_buffer(const at::Tensor& buffer, int64_t root, RedOp op) {
  if (single_host()) {
    communicator_.reduce(descriptor(OpKind::Reduce, buffer, bytes_of(buffer), root, op), buffer, buffer,
                         ReduceMode::Root, op);
    return;
  }
  // Partial results go through a scratch copy: only the root's tensor may change.
  const at::Tensor scratch = buffer.clone();
  const RedOp step = op == RedOp::AVG ? RedOp::SUM : op;
  communicator_.reduce(descriptor(OpKind::Reduce, scratch, bytes_of(scratch), 0, step), scratch, scratch,
                       ReduceMode::Root, step);
  const int root_host = hosts_.host_of_rank[root];
  if (leaders_) {
    std::vector<at::Tensor> tensors{scratch};
    c10d::ReduceOptions options;
    options.reduceOp = c10d::ReduceOp(step);
    options.rootRank = root_host;
    leaders_->reduce(tensors, options)->wait();
  }
  if (hosts_.host == root_host) {
    const int local_root = hosts_.local_index_of(static_cast<int>(root));
    if (local_root != 0) {
      host_broadcast(scratch, 0, local_root);
    }
    if (rank_ == root) {
      if (op == RedOp::AVG) {
        divide_by_count(scratch, size_);
      }
      buffer.copy_(scratch);
    }
  }
}

void ProcessGroupShm::barrier_all() {
  OpDescriptor d{};
  d.op = static_cast<uint32_t>(OpKind::Barrier);
  d.root = -1;
  communicator_.exchange(d, nullptr, 0, {});
  if (!single_host()) {
    if (leaders_) {
      leaders_->barrier()->wait();
    }
    communicator_.exchange(d, nullptr, 0, {});
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  const at::Tensor& tensor = single(tensors, "broadcast");
  const int64_t root = opts.rootRank;
  check_root(root, size_, "broadcast");
  return enqueue(c10d::OpType::BROADCAST, tensors, bytes_of(tensor), [this, tensor, root] {
    Landing landing(tensor);
    broadcast_buffer(landing.buffer, root);
    landing.deliver();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  if (tensors.size() == 1 && tensors[0].is_sparse() && tensors[0].device().is_cpu()) {
    // Sparse (COO) tensors: Gloo all-gathers every rank's indices and values and sums them.
    return via_gloo(c10d::OpType::ALLREDUCE, tensors, [tensors, opts](c10d::Backend& gloo) mutable {
      return gloo.allreduce(tensors, opts);
    });
  }
  const at::Tensor& tensor = single(tensors, "allreduce");
  const RedOp op = opts.reduceOp.op_;
  check_reducible(tensor.scalar_type(), op, "allreduce");
  return enqueue(c10d::OpType::ALLREDUCE, tensors, bytes_of(tensor), [this, tensor, op] {
    Landing landing(tensor);
    allreduce_buffer(landing.buffer, op);
    landing.deliver();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "shm backend: allreduce_coalesced needs at least one tensor");
  const RedOp op = opts.reduceOp.op_;
  for (const auto& tensor : tensors) {
    check_cpu_dense(tensor, "allreduce_coalesced");
    TORCH_CHECK(tensor.scalar_type() == tensors[0].scalar_type(),
                "shm backend: allreduce_coalesced needs tensors of one dtype, got ", tensors[0].scalar_type(),
                " and ", tensor.scalar_type());
  }
  check_reducible(tensors[0].scalar_type(), op, "allreduce_coalesced");
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, tensors, total_bytes(tensors), [this, tensors, op] {
    if (single_host() && contiguous_and_apart(tensors)) {
      // Reduced where they lie: no packing into one buffer and back.
      std::vector<std::pair<char*, uint64_t>> pieces;
      for (const auto& tensor : tensors) {
        pieces.emplace_back(static_cast<char*>(tensor.data_ptr()), bytes_of(tensor));
      }
      const Pieces in_place(pieces);
      communicator_.reduce(descriptor(OpKind::Allreduce, tensors[0], total_bytes(tensors), -1, op), in_place,
                           in_place, tensors[0].scalar_type(), ReduceMode::All, op);
      return;
    }
    at::Tensor flat = flatten(tensors);
    allreduce_buffer(flat, op);
    unflatten_into(flat, tensors);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  const at::Tensor& tensor = single(tensors, "reduce");
  const RedOp op = opts.reduceOp.op_;
  const int64_t root = opts.rootRank;
  check_reducible(tensor.scalar_type(), op, "reduce");
  check_root(root, size_, "reduce");
  return enqueue(c10d::OpType::REDUCE, tensors, bytes_of(tensor), [this, tensor, op, root] {
    Landing landing(tensor);
    reduce_buffer(landing.buffer, root, op);
    if (rank_ == root) {
      landing.deliver();
    }
  });
}

void ProcessGroupShm::all_gather_into(const at::Tensor& output, const at::Tensor& input) {
  const at::Tensor source = input.contiguous();
  Landing landing(output);
  const uint64_t bytes = bytes_of(source);
  if (single_host()) {
    std::vector<Want> wants;
    for (int rank = 0; rank < size_; ++rank) {
      wants.push_back({rank, 0, bytes, landing.data() + rank * bytes});
    }
    communicator_.exchange(descriptor(OpKind::Allgather, source, bytes),
                           static_cast<const char*>(source.const_data_ptr()), bytes, wants);
    landing.deliver();
    return;
  }
  // Gather each host's blocks at its leader, allgather the (padded) host blocks among leaders,
  // put them in rank order, and broadcast the result within each host.
  std::size_t widest = 0;
  for (const auto& ranks : hosts_.ranks_on_host) {
    widest = std::max(widest, ranks.size());
  }
  at::Tensor host_blocks = at::empty({static_cast<int64_t>(widest) * source.numel()}, source.options());
  std::vector<Want> wants;
  if (hosts_.leader()) {
    for (std::size_t i = 0; i < hosts_.local_ranks().size(); ++i) {
      wants.push_back({static_cast<int>(i), 0, bytes, static_cast<char*>(host_blocks.data_ptr()) + i * bytes});
    }
  }
  communicator_.exchange(descriptor(OpKind::Gather, source, bytes, 0),
                         static_cast<const char*>(source.const_data_ptr()), bytes, wants);
  if (leaders_) {
    at::Tensor every_host = at::empty({hosts_.host_count() * host_blocks.numel()}, source.options());
    leaders_->_allgather_base(every_host, host_blocks)->wait();
    const char* from = static_cast<const char*>(every_host.const_data_ptr());
    for (int host = 0; host < hosts_.host_count(); ++host) {
      const auto& ranks = hosts_.ranks_on_host[host];
      for (std::size_t i = 0; i < ranks.size(); ++i) {
        std::memcpy(landing.data() + ranks[i] * bytes, from + (host * widest + i) * bytes, bytes);
      }
    }
  }
  host_broadcast(landing.buffer, 0);
  landing.deliver();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const at::Tensor& input = single(inputs, "allgather");
  TORCH_CHECK(outputs.size() == 1 && outputs[0].size() == static_cast<std::size_t>(size_),
              "shm backend: allgather needs one output list of ", size_, " tensors");
  for (const auto& output : outputs[0]) {
    check_same(output, input, "allgather", "output tensor");
  }
  return enqueue(c10d::OpType::ALLGATHER, outputs[0], size_ * bytes_of(input), [this, input, outputs = outputs[0]] {
    at::Tensor gathered = at::empty({size_ * input.numel()}, input.options());
    all_gather_into(gathered, input);
    unflatten_into(gathered, outputs);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  check_cpu_dense(input, "allgather_into_tensor");
  check_cpu_dense(output, "allgather_into_tensor");
  TORCH_CHECK(output.scalar_type() == input.scalar_type() && output.numel() == size_ * input.numel(),
              "shm backend: allgather_into_tensor needs an output of ", size_, " x the input (", input.numel(),
              " elements of ", input.scalar_type(), "), got ", output.numel(), " of ", output.scalar_type());
  return enqueue(c10d::OpType::_ALLGATHER_BASE, {output}, bytes_of(output), [this, output, input] { all_gather_into(output, input); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(output_lists.size() == static_cast<std::size_t>(size_),
              "shm backend: allgather_coalesced needs one output list per rank (", size_, "), got ",
              output_lists.size());
  std::vector<at::Tensor> outputs;
  for (int rank = 0; rank < size_; ++rank) {
    TORCH_CHECK(output_lists[rank].size() == inputs.size(), "shm backend: allgather_coalesced: output list ", rank,
                " holds ", output_lists[rank].size(), " tensors for ", inputs.size(), " inputs");
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      check_same(output_lists[rank][i], inputs[i], "allgather_coalesced", "output tensor");
      outputs.push_back(output_lists[rank][i]);
    }
  }
  if (!single_host()) {
    return via_gloo(c10d::OpType::ALLGATHER_COALESCED, outputs, [output_lists, inputs, opts](c10d::Backend& gloo) mutable {
      return gloo.allgather_coalesced(output_lists, inputs, opts);
    });
  }
  // Inputs may differ in dtype: they travel as one byte stream per rank.
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, outputs, size_ * total_bytes(inputs), [this, output_lists, inputs] {
    const at::Tensor packed = byte_concatenation(inputs);
    const at::Tensor gathered = at::empty({size_ * packed.numel()}, packed.options());
    all_gather_into(gathered, packed);
    const char* cursor = static_cast<const char*>(gathered.const_data_ptr());
    for (const auto& outputs_of_rank : output_lists) {
      for (const auto& output : outputs_of_rank) {
        Landing landing(output);
        std::memcpy(landing.data(), cursor, bytes_of(output));
        landing.deliver();
        cursor += bytes_of(output);
      }
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "shm backend: allgather_into_tensor_coalesced needs as many outputs (",
              outputs.size(), ") as inputs (", inputs.size(), ")");
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    check_cpu_dense(inputs[i], "allgather_into_tensor_coalesced");
    TORCH_CHECK(outputs[i].scalar_type() == inputs[i].scalar_type() && outputs[i].numel() == size_ * inputs[i].numel(),
                "shm backend: allgather_into_tensor_coalesced: output ", i, " must hold ", size_, " x input ", i);
  }
  return enqueue(c10d::OpType::COALESCED, outputs, total_bytes(outputs), [this, outputs, inputs] {
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      all_gather_into(outputs[i], inputs[i]);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  if (!single_host()) {
    return via_gloo(c10d::OpType::GATHER, {}, [outputs, inputs, opts](c10d::Backend& gloo) mutable {
      return gloo.gather(outputs, inputs, opts);
    });
  }
  const at::Tensor& input = single(inputs, "gather");
  const int64_t root = opts.rootRank;
  check_root(root, size_, "gather");
  std::vector<at::Tensor> landing_tensors;
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1 && outputs[0].size() == static_cast<std::size_t>(size_),
                "shm backend: gather needs one output list of ", size_, " tensors on the root");
    for (const auto& output : outputs[0]) {
      check_same(output, input, "gather", "output tensor");
    }
    landing_tensors = outputs[0];
  } else {
    TORCH_CHECK(outputs.empty() || outputs[0].empty(), "shm backend: gather takes output tensors on the root only");
  }
  return enqueue(c10d::OpType::GATHER, landing_tensors, size_ * bytes_of(input), [this, input, landing_tensors, root] {
    const at::Tensor source = input.contiguous();
    const uint64_t bytes = bytes_of(source);
    std::vector<Landing> landings(landing_tensors.begin(), landing_tensors.end());
    std::vector<Want> wants;
    for (int rank = 0; rank < static_cast<int>(landings.size()); ++rank) {
      wants.push_back({rank, 0, bytes, landings[rank].data()});
    }
    communicator_.exchange(descriptor(OpKind::Gather, source, bytes, root),
                           static_cast<const char*>(source.const_data_ptr()), bytes, wants);
    for (const auto& landing : landings) {
      landing.deliver();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  if (!single_host()) {
    return via_gloo(c10d::OpType::SCATTER, outputs, [outputs, inputs, opts](c10d::Backend& gloo) mutable {
      return gloo.scatter(outputs, inputs, opts);
    });
  }
  const at::Tensor& output = single(outputs, "scatter");
  const int64_t root = opts.rootRank;
  check_root(root, size_, "scatter");
  at::Tensor stream;
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1 && inputs[0].size() == static_cast<std::size_t>(size_),
                "shm backend: scatter needs one input list of ", size_, " tensors on the root");
    for (const auto& input : inputs[0]) {
      check_same(input, output, "scatter", "input tensor");
    }
    stream = flatten(inputs[0]);
  } else {
    TORCH_CHECK(inputs.empty() || inputs[0].empty(), "shm backend: scatter takes input tensors on the root only");
  }
  return enqueue(c10d::OpType::SCATTER, outputs, size_ * bytes_of(output), [this, output, stream, root] {
    Landing landing(output);
    const uint64_t bytes = bytes_of(output);
    const std::vector<Want> wants{{static_cast<int>(root), rank_ * bytes, bytes, landing.data()}};
    const bool sending = rank_ == root;
    communicator_.exchange(descriptor(OpKind::Scatter, output, bytes, root),
                           sending ? static_cast<const char*>(stream.const_data_ptr()) : nullptr,
                           sending ? bytes_of(stream) : 0, wants);
    landing.deliver();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (!single_host()) {
    return via_gloo(c10d::OpType::REDUCE_SCATTER, outputs, [outputs, inputs, opts](c10d::Backend& gloo) mutable {
      return gloo.reduce_scatter(outputs, inputs, opts);
    });
  }
  const at::Tensor& output = single(outputs, "reduce_scatter");
  const RedOp op = opts.reduceOp.op_;
  check_reducible(output.scalar_type(), op, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1 && inputs[0].size() == static_cast<std::size_t>(size_),
              "shm backend: reduce_scatter needs one input list of ", size_, " tensors");
  for (const auto& input : inputs[0]) {
    check_same(input, output, "reduce_scatter", "input tensor");
  }
  return enqueue(c10d::OpType::REDUCE_SCATTER, outputs, size_ * bytes_of(output), [this, output, inputs = inputs[0], op] {
    const at::Tensor flat = flatten(inputs);
    Landing landing(output);
    communicator_.reduce(descriptor(OpKind::ReduceScatter, flat, bytes_of(flat), -1, op), flat, landing.buffer,
                         ReduceMode::Scatter, op);
    landing.deliver();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  if (!single_host()) {
    return via_gloo(c10d::OpType::_REDUCE_SCATTER_BASE, {output}, [output, input, opts](c10d::Backend& gloo) mutable {
      return gloo._reduce_scatter_base(output, input, opts);
    });
  }
  check_cpu_dense(input, "reduce_scatter_tensor");
  check_cpu_dense(output, "reduce_scatter_tensor");
  const RedOp op = opts.reduceOp.op_;
  check_reducible(input.scalar_type(), op, "reduce_scatter_tensor");
  TORCH_CHECK(input.scalar_type() == output.scalar_type() && input.numel() == size_ * output.numel(),
              "shm backend: reduce_scatter_tensor needs an input of ", size_, " x the output (", output.numel(),
              " elements of ", output.scalar_type(), "), got ", input.numel(), " of ", input.scalar_type());
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, {output}, bytes_of(input), [this, output, input, op] {
    const at::Tensor source = input.contiguous();
    Landing landing(output);
    communicator_.reduce(descriptor(OpKind::ReduceScatter, source, bytes_of(source), -1, op), source,
                         landing.buffer, ReduceMode::Scatter, op);
    landing.deliver();
  });
}

void ProcessGroupShm::exchange_all_to_all(
    const at::Tensor& output,
    const at::Tensor& input,
    std::vector<int64_t> output_splits,
    std::vector<int64_t> input_splits,
    int64_t row_bytes) {
  // First every rank learns every rank's splits, so all can check that they fit together.
  const std::size_t world = static_cast<std::size_t>(size_);
  std::vector<int64_t> mine(input_splits);
  mine.insert(mine.end(), output_splits.begin(), output_splits.end());
  std::vector<int64_t> all(2 * world * world);
  std::vector<Want> wants;
  const uint64_t split_bytes = 2 * world * sizeof(int64_t);
  for (int rank = 0; rank < size_; ++rank) {
    wants.push_back({rank, 0, split_bytes, reinterpret_cast<char*>(all.data() + 2 * world * rank)});
  }
  OpDescriptor splits_descriptor = descriptor(OpKind::AllToAll, input, split_bytes);
  splits_descriptor.dtype = static_cast<int32_t>(c10::kLong);
  communicator_.exchange(splits_descriptor, reinterpret_cast<const char*>(mine.data()), split_bytes, wants);
  auto sends = [&](std::size_t from, std::size_t to) { return all[2 * world * from + to]; };
  auto expects = [&](std::size_t at, std::size_t from) { return all[2 * world * at + world + from]; };
  for (std::size_t from = 0; from < world; ++from) {
    for (std::size_t to = 0; to < world; ++to) {
      TORCH_CHECK(sends(from, to) == expects(to, from), "shm backend: alltoall split sizes do not fit: rank ", from,
                  " sends ", sends(from, to), " rows to rank ", to, ", which expects ", expects(to, from));
    }
  }

  Landing landing(output);
  const at::Tensor source = input.contiguous();
  wants.clear();
  int64_t received = 0;
  for (std::size_t from = 0; from < world; ++from) {
    int64_t offset = 0;
    for (std::size_t to = 0; to < static_cast<std::size_t>(rank_); ++to) {
      offset += sends(from, to);
    }
    const int64_t rows = sends(from, rank_);
    wants.push_back({static_cast<int>(from), static_cast<uint64_t>(offset * row_bytes),
                     static_cast<uint64_t>(rows * row_bytes), landing.data() + received * row_bytes});
    received += rows;
  }
  communicator_.exchange(descriptor(OpKind::AllToAll, source, static_cast<uint64_t>(row_bytes)),
                         static_cast<const char*>(source.const_data_ptr()), bytes_of(source), wants);
  landing.deliver();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& output_splits,
    std::vector<int64_t>& input_splits,
    const c10d::AllToAllOptions& opts) {
  if (!single_host()) {
    return via_gloo(c10d::OpType::ALLTOALL_BASE, {output},
                    [output, input, output_splits, input_splits, opts](c10d::Backend& gloo) mutable {
                      return gloo.alltoall_base(output, input, output_splits, input_splits, opts);
                    });
  }
  check_cpu_dense(input, "alltoall");
  check_cpu_dense(output, "alltoall");
  TORCH_CHECK(input.scalar_type() == output.scalar_type(), "shm backend: alltoall needs input and output of one dtype");
  auto resolve = [this](const at::Tensor& tensor, const std::vector<int64_t>& splits, const char* which) {
    const int64_t rows = tensor.dim() == 0 ? 1 : tensor.size(0);
    if (splits.empty()) {
      TORCH_CHECK(rows % size_ == 0, "shm backend: alltoall without splits needs the ", which, "'s first dimension (",
                  rows, ") divisible by the group size ", size_);
      return std::vector<int64_t>(size_, rows / size_);
    }
    TORCH_CHECK(splits.size() == static_cast<std::size_t>(size_), "shm backend: alltoall needs ", size_, " ", which,
                " split sizes, got ", splits.size());
    int64_t total = 0;
    for (int64_t split : splits) {
      TORCH_CHECK(split >= 0, "shm backend: alltoall split sizes must not be negative");
      total += split;
    }
    TORCH_CHECK(total == rows, "shm backend: alltoall ", which, " splits add up to ", total, " rows, the ", which,
                " has ", rows);
    return splits;
  };
  const auto ins = resolve(input, input_splits, "input");
  const auto outs = resolve(output, output_splits, "output");
  // A row is everything behind the first dimension; its size must not depend on how many rows a
  // rank has (it may have none).
  auto row_shape = [](const at::Tensor& tensor) {
    return tensor.dim() <= 1 ? std::vector<int64_t>{} : tensor.sizes().slice(1).vec();
  };
  TORCH_CHECK(row_shape(input) == row_shape(output), "shm backend: alltoall needs input and output rows of one shape, ",
              "got ", input.sizes(), " and ", output.sizes());
  int64_t row_bytes = static_cast<int64_t>(input.element_size());
  for (int64_t extent : row_shape(input)) {
    row_bytes *= extent;
  }
  return enqueue(c10d::OpType::ALLTOALL_BASE, {output}, bytes_of(input), [this, output, input, ins, outs, row_bytes] {
    exchange_all_to_all(output, input, outs, ins, row_bytes);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  if (!single_host()) {
    return via_gloo(c10d::OpType::ALLTOALL, outputs, [outputs, inputs, opts](c10d::Backend& gloo) mutable {
      return gloo.alltoall(outputs, inputs, opts);
    });
  }
  TORCH_CHECK(inputs.size() == static_cast<std::size_t>(size_) && outputs.size() == inputs.size(),
              "shm backend: alltoall needs ", size_, " input and ", size_, " output tensors");
  std::vector<int64_t> ins;
  std::vector<int64_t> outs;
  for (int rank = 0; rank < size_; ++rank) {
    check_cpu_dense(inputs[rank], "alltoall");
    check_cpu_dense(outputs[rank], "alltoall");
    TORCH_CHECK(inputs[rank].scalar_type() == inputs[0].scalar_type() &&
                    outputs[rank].scalar_type() == inputs[0].scalar_type(),
                "shm backend: alltoall needs tensors of one dtype");
    ins.push_back(inputs[rank].numel());
    outs.push_back(outputs[rank].numel());
  }
  return enqueue(c10d::OpType::ALLTOALL, outputs, total_bytes(inputs), [this, outputs, inputs, ins, outs] {
    const at::Tensor flat_in = flatten(inputs);
    int64_t total = 0;
    for (int64_t n : outs) {
      total += n;
    }
    at::Tensor flat_out = at::empty({total}, flat_in.options());
    exchange_all_to_all(flat_out, flat_in, outs, ins, static_cast<int64_t>(flat_in.element_size()));
    unflatten_into(flat_out, outputs);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(c10d::OpType::BARRIER, {}, 0, [this] { barrier_all(); });
}

void ProcessGroupShm::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  ++collectives_issued_;
  gloo_->monitoredBarrier(opts, wait_all_ranks);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  return gloo_->send(tensors, dst, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  return gloo_->recv(tensors, src, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupShm::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return gloo_->recvAnysource(tensors, tag);
}

c10::intrusive_ptr<c10d::Backend> make_shm_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout) {
  return c10::make_intrusive<ProcessGroupShm>(store, rank, size, timeout);
}

} // namespace torchpar::comm::shm
