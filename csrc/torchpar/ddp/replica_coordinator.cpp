#include <torchpar/ddp/replica_coordinator.h>

#include <torchpar/common/bucket_assignment.h>
#include <torchpar/common/control_collectives.h>
#include <torchpar/common/replica_check.h>
#include <torchpar/ddp/reducer.h>
#include <torchpar/ddp/timeline.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <algorithm>
#include <cstdint>
#include <sstream>

namespace torchpar::ddp {
namespace {

constexpr size_t kBroadcastBucketBytes = 250u << 20;  // torch DDP's broadcast bucket

} // namespace

ReplicaCoordinator::ReplicaCoordinator(
    NamedTensors parameters, NamedTensors buffers, DistributedDataParallelOptions options)
    : parameters_(std::move(parameters)), buffers_(std::move(buffers)), options_(std::move(options)) {
  TORCH_CHECK(
      options_.process_group(),
      "DistributedDataParallel: no process group; set DistributedDataParallelOptions::process_group to the "
      "group torchpar::init_process_group returned");
  TORCH_CHECK(options_.bucket_cap_mb() > 0, "DistributedDataParallel: bucket_cap_mb must be > 0, got ",
              options_.bucket_cap_mb());
  if (!options_.data_process_group()) {
    options_.data_process_group(options_.process_group());
  } else {
    const auto& data = options_.data_process_group();
    const auto& group = *options_.process_group();
    TORCH_CHECK(data->getSize() == group.getSize() && data->getRank() == group.getRank(),
                "DistributedDataParallel: data_process_group must hold the process group's ranks in the same "
                "order; it has ", data->getSize(), " ranks with this one as rank ", data->getRank(),
                ", the process group ", group.getSize(), " with this one as rank ", group.getRank());
  }
  for (double cap : options_.bucket_cap_mb_list()) {
    TORCH_CHECK(cap > 0, "DistributedDataParallel: every entry of bucket_cap_mb_list must be > 0, got ",
                c10::ArrayRef<double>(options_.bucket_cap_mb_list()));
  }
  if (options_.init_sync()) {
    verify_replicas_match();
    broadcast_state(/*source_rank=*/0, /*include_parameters=*/true, options_.init_sync_buffers());
    peers_ = PeerProcesses::gather(*options_.process_group(), device());
  }
  timeline_ = Timeline::from_environment(options_.process_group()->getRank());

  std::vector<at::Tensor> trainable;
  std::vector<std::string> names;
  for (const auto& [name, parameter] : parameters_) {
    if (parameter.requires_grad()) {
      trainable.push_back(parameter);
      names.push_back(name);
    }
  }
  ReducerOptions reducer_options;
  auto bytes = [](double mebibytes) { return static_cast<size_t>(mebibytes * (1 << 20)); };
  if (options_.bucket_cap_mb_list().empty()) {
    reducer_options.bucket_caps_bytes =
        first_and_later_caps(bytes(options_.first_bucket_cap_mb()), bytes(options_.bucket_cap_mb()));
  } else {
    reducer_options.bucket_caps_bytes.clear();
    for (double cap : options_.bucket_cap_mb_list()) {
      reducer_options.bucket_caps_bytes.push_back(bytes(cap));
    }
  }
  reducer_options.find_unused_parameters = options_.find_unused_parameters();
  reducer_options.gradient_as_bucket_view = options_.gradient_as_bucket_view();
  reducer_options.static_graph = options_.static_graph();
  reducer_options.data_process_group = options_.data_process_group();
  reducer_ = std::make_unique<Reducer>(
      std::move(trainable), std::move(names), options_.process_group(), reducer_options, timeline_, peers_);
}

ReplicaCoordinator::~ReplicaCoordinator() = default;

void ReplicaCoordinator::verify_replicas_match() const {
  check_same_model(*options_.process_group(), parameters_, buffers_, device(), "DistributedDataParallel");
}

void ReplicaCoordinator::broadcast_state(int source_rank, bool include_parameters, bool include_buffers) {
  std::vector<at::Tensor> tensors;
  if (include_parameters) {
    for (const auto& [name, parameter] : parameters_) {
      tensors.push_back(parameter);
    }
  }
  if (include_buffers) {
    for (const auto& [name, buffer] : buffers_) {
      tensors.push_back(buffer);
    }
  }
  if (tensors.empty()) {
    return;
  }
  at::NoGradGuard no_grad;
  c10d::broadcast_coalesced(options_.data_process_group(), tensors, kBroadcastBucketBytes, source_rank);
}

at::Device ReplicaCoordinator::device() const {
  return parameters_.empty() ? at::Device(at::kCPU) : parameters_.front().second.device();
}

bool ReplicaCoordinator::will_sync() const {
  return grad_sync_ && at::GradMode::is_enabled();
}

void ReplicaCoordinator::pre_forward(bool will_sync) {
  try {
    synchronise_before_forward(will_sync);
  } catch (const c10::Error& error) {
    TORCH_CHECK(false, peers_.explain(error.what_without_backtrace()));
  }
}

void ReplicaCoordinator::synchronise_before_forward(bool will_sync) {
  forward_began_at_ = std::chrono::system_clock::now();
  const bool broadcast_buffers = options_.broadcast_buffers() && !buffers_.empty() && sync_buffers_next_forward_;
  int buffer_source = 0;
  if (join_enabled_) {
    const auto status = exchange_join_status(true, will_sync, broadcast_buffers);
    ++joined_forwards_;
    // The highest active rank is the authority: lower ones may have stopped training already.
    buffer_source = status.active_ranks.back();
    if (!divide_by_initial_world_size_) {
      reducer_->set_gradient_divisor(static_cast<int>(status.active_ranks.size()));
    }
  }
  if (will_sync) {
    reducer_->rebuild_buckets_if_due();
  }
  if (broadcast_buffers) {
    broadcast_state(buffer_source, /*include_parameters=*/false);
  }
}

void ReplicaCoordinator::post_forward(const std::vector<at::Tensor>& outputs, bool will_sync) {
  sync_buffers_next_forward_ = will_sync;
  reducer_->follow_replaced_grad_accumulators();
  if (will_sync) {
    reducer_->prepare_for_backward(outputs);
  }
  if (timeline_) {
    timeline_->span("forward", "forward", forward_began_at_);
  }
}

ReplicaCoordinator::JoinStatus ReplicaCoordinator::exchange_join_status(
    bool active, bool will_sync, bool will_broadcast_buffers) {
  auto& group = *options_.process_group();
  const int world = group.getSize();
  // Slots 0..world-1: who is active; world: how many synchronise; world+1: how many broadcast buffers.
  auto status = at::zeros({world + 2}, at::kInt);
  auto* slots = status.data_ptr<int32_t>();
  slots[group.getRank()] = active ? 1 : 0;
  slots[world] = active && will_sync ? 1 : 0;
  slots[world + 1] = active && will_broadcast_buffers ? 1 : 0;
  status = all_reduce_sum(group, status, device());
  slots = status.data_ptr<int32_t>();
  JoinStatus result;
  for (int r = 0; r < world; ++r) {
    if (slots[r]) {
      result.active_ranks.push_back(r);
    }
  }
  const int active_count = static_cast<int>(result.active_ranks.size());
  TORCH_CHECK(
      (slots[world] == 0 || slots[world] == active_count) && (slots[world + 1] == 0 || slots[world + 1] == active_count),
      "DistributedDataParallel join (rank ", group.getRank(), "): the ", active_count,
      " active ranks disagree about this iteration: ", slots[world], " synchronise gradients and ", slots[world + 1],
      " broadcast buffers; every rank must enter no_sync / torch.no_grad together");
  result.syncing_gradients = slots[world] > 0;
  result.broadcasting_buffers = slots[world + 1] > 0;
  return result;
}

void ReplicaCoordinator::begin_join(bool divide_by_initial_world_size) {
  TORCH_CHECK(!join_enabled_, "DistributedDataParallel: join contexts cannot be nested");
  join_enabled_ = true;
  divide_by_initial_world_size_ = divide_by_initial_world_size;
  joined_forwards_ = 0;
}

void ReplicaCoordinator::cancel_join() {
  join_enabled_ = false;
  reducer_->set_gradient_divisor(options_.process_group()->getSize());
}

void ReplicaCoordinator::finish_join() {
  TORCH_CHECK(join_enabled_, "DistributedDataParallel: finish_join without begin_join");
  join_enabled_ = false;
  while (shadow_iteration()) {
  }
  synchronise_final_model();
}

bool ReplicaCoordinator::shadow_iteration() {
  const auto status = exchange_join_status(false, false, false);
  if (status.active_ranks.empty()) {
    return false;
  }
  if (status.syncing_gradients) {
    reducer_->rebuild_buckets_if_due();
    if (!divide_by_initial_world_size_) {
      // The divisor the active ranks use: it decides how they all-reduce, which this rank must match.
      reducer_->set_gradient_divisor(static_cast<int>(status.active_ranks.size()));
    }
  }
  if (status.broadcasting_buffers) {
    broadcast_state(status.active_ranks.back(), /*include_parameters=*/false);
  }
  if (status.syncing_gradients) {
    reducer_->shadow_backward();
  }
  return true;
}

void ReplicaCoordinator::synchronise_final_model() {
  join_enabled_ = false;
  // The rank that ran the most forwards (the highest such rank) holds the final model.
  auto& group = *options_.process_group();
  auto forwards = at::zeros({group.getSize()}, at::kLong);
  forwards.data_ptr<int64_t>()[group.getRank()] = joined_forwards_;
  forwards = all_reduce_sum(group, forwards, device());
  const auto* counts = forwards.data_ptr<int64_t>();
  int authority = 0;
  for (int r = 1; r < group.getSize(); ++r) {
    if (counts[r] >= counts[authority]) {
      authority = r;
    }
  }
  broadcast_state(authority, /*include_parameters=*/true);
  sync_buffers_next_forward_ = true;
  joined_forwards_ = 0;
  reducer_->set_gradient_divisor(group.getSize());
}

void ReplicaCoordinator::set_static_graph() {
  options_.static_graph(true);
  reducer_->set_static_graph();
}

c10::intrusive_ptr<c10d::ProcessGroup> ReplicaCoordinator::comm_hook_group(
    c10::intrusive_ptr<c10d::ProcessGroup> requested) const {
  if (!requested || requested == options_.process_group()) {
    return options_.data_process_group();
  }
  return requested;
}

void ReplicaCoordinator::register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook) {
  reducer_->register_comm_hook(std::move(hook));
}

} // namespace torchpar::ddp
