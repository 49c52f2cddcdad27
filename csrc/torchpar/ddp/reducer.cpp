#include <torchpar/ddp/reducer.h>

#include <torchpar/comm/coalesced_in_place.h>
#include <torchpar/common/bucket_assignment.h>
#include <torchpar/common/control_collectives.h>
#include <torchpar/common/error_message.h>
#include <torchpar/common/gradient_hooks.h>
#include <torchpar/ddp/timeline.h>

#include <ATen/ScalarOps.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/irange.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <sstream>
#include <unordered_set>

namespace torchpar::ddp {
namespace {

} // namespace

Reducer::Reducer(
    std::vector<at::Tensor> parameters,
    std::vector<std::string> names,
    c10::intrusive_ptr<c10d::ProcessGroup> process_group,
    ReducerOptions options,
    std::shared_ptr<Timeline> timeline,
    PeerProcesses peers)
    : parameters_(std::move(parameters)),
      names_(std::move(names)),
      process_group_(std::move(process_group)),
      options_(options),
      timeline_(std::move(timeline)),
      peers_(std::move(peers)) {
  TORCH_CHECK(process_group_ && options_.data_process_group, "DistributedDataParallel: no process group given");
  TORCH_CHECK(!parameters_.empty(), "DistributedDataParallel: the module has no parameters that require grad");
  TORCH_CHECK(
      names_.size() == parameters_.size(), "DistributedDataParallel: ", parameters_.size(), " parameters but ",
      names_.size(), " names");
  for (const auto i : c10::irange(parameters_.size())) {
    const auto& parameter = parameters_[i];
    TORCH_CHECK(
        parameter.requires_grad() && parameter.is_leaf(), "DistributedDataParallel: parameter ", names_[i],
        " is not a leaf tensor that requires grad");
    TORCH_CHECK(
        parameter.device() == parameters_[0].device(), "DistributedDataParallel: parameter ", names_[i], " is on ",
        parameter.device(), " but ", names_[0], " is on ", parameters_[0].device(),
        "; one replica per process must live on one device");
    TORCH_CHECK(
        parameter.layout() == c10::kStrided, "DistributedDataParallel: parameter ", names_[i],
        " is not a dense tensor");
  }
  locally_used_ = at::zeros({static_cast<int64_t>(parameters_.size())}, at::TensorOptions().dtype(at::kInt));
  average_scale_ = at::native::wrapped_scalar_tensor(1.0 / world_size());
  divisor_ = world_size();
  // The gradients then stay the tensors autograd made, as without in-place reduction; with
  // gradient_as_bucket_view they are the bucket's views, reduced in the bucket.
  in_place_capable_ = !options_.gradient_as_bucket_view && device().is_cpu() &&
      options_.data_process_group->getSize() == world_size() &&
      comm::reduces_coalesced_in_place(*options_.data_process_group);
  ready_.assign(parameters_.size(), false);
  build_buckets(reverse_registration_order(parameters_.size()));
  gradient_hooks_ = std::make_unique<GradientReadyHooks>(
      parameters_, [this](size_t index) { on_gradient_accumulated(index); });
}

Reducer::~Reducer() = default;

void Reducer::set_gradient_divisor(int divisor) {
  TORCH_CHECK(divisor > 0, "DistributedDataParallel: gradient divisor must be positive, got ", divisor);
  average_scale_ = at::native::wrapped_scalar_tensor(1.0 / divisor);
  divisor_ = divisor;
}

bool Reducer::reducing_in_place() const {
  // AVG divides by the group's size; every rank decides alike (a rank that joined shadows the
  // others with the divisor they use).
  return in_place_capable_ && !comm_hook_ && divisor_ == world_size();
}

void Reducer::set_static_graph() {
  TORCH_CHECK(iteration_ == 0 && !armed_,
              "DistributedDataParallel: static_graph is learnt from the first backward, so _set_static_graph() "
              "should be called before training loop starts and after DistributedDataParallel is constructed "
              "(or pass static_graph=True to the constructor)");
  options_.static_graph = true;
}

int Reducer::rank() const {
  return process_group_->getRank();
}

int Reducer::world_size() const {
  return process_group_->getSize();
}

at::Device Reducer::device() const {
  return parameters_.front().device();
}

void Reducer::build_buckets(const std::vector<size_t>& order) {
  std::vector<BucketableParameter> sizes;
  sizes.reserve(parameters_.size());
  for (const auto& parameter : parameters_) {
    sizes.push_back({static_cast<size_t>(parameter.numel()) * parameter.element_size(), parameter.scalar_type()});
  }
  const auto assignment =
      assign_buckets(sizes, order, options_.bucket_caps_bytes);
  buckets_.clear();
  locations_.assign(parameters_.size(), Location{});
  at::NoGradGuard no_grad;
  for (const auto& indices : assignment) {
    Bucket bucket;
    bucket.parameter_indices = indices;
    size_t total = 0;
    for (size_t index : indices) {
      bucket.offsets.push_back(total);
      bucket.lengths.push_back(parameters_[index].numel());
      bucket.sizes.push_back(parameters_[index].sizes().vec());
      total += parameters_[index].numel();
    }
    const auto& first = parameters_[indices.front()];
    bucket.flat = at::zeros({static_cast<int64_t>(total)}, first.options());
    for (const auto slot : c10::irange(indices.size())) {
      const size_t index = indices[slot];
      locations_[index] = Location{buckets_.size(), slot};
      // Shares the bucket's storage without being an autograd view: optimizers (LibTorch's in
      // particular) detach_() gradients in zero_grad, which autograd forbids on views.
      auto view = at::empty({0}, bucket.flat.options());
      view.set_(
          bucket.flat.storage(), static_cast<int64_t>(bucket.offsets[slot]), bucket.sizes[slot],
          c10::contiguous_strides(bucket.sizes[slot]));
      if (options_.gradient_as_bucket_view) {
        auto& grad = parameters_[index].mutable_grad();
        if (grad.defined()) {
          view.copy_(grad);
          grad = view;
        }
      }
      bucket.views.push_back(std::move(view));
    }
    bucket.pending = indices.size();
    bucket.inputs = bucket.views;
    bucket.reduced_in_gradient.assign(indices.size(), false);
    buckets_.push_back(std::move(bucket));
  }
}

void Reducer::follow_replaced_grad_accumulators() {
  std::lock_guard<std::mutex> lock(mutex_);
  gradient_hooks_->follow_replaced_accumulators();
}

std::vector<std::vector<size_t>> Reducer::bucket_indices() const {
  std::vector<std::vector<size_t>> result;
  for (const auto& bucket : buckets_) {
    result.push_back(bucket.parameter_indices);
  }
  return result;
}

void Reducer::register_comm_hook(std::unique_ptr<c10d::CommHookInterface> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(hook, "register_comm_hook: the hook is null");
  TORCH_CHECK(!comm_hook_, "register_comm_hook: a communication hook is already registered; it can be set only once");
  TORCH_CHECK(
      iteration_ == 0 && !backward_started_,
      "register_comm_hook: register the hook before the first backward");
  comm_hook_ = std::move(hook);
}

bool Reducer::rebuild_buckets_if_due() {
  std::lock_guard<std::mutex> lock(mutex_);
  const bool rebuild_allowed = !options_.find_unused_parameters || options_.static_graph;
  if (buckets_rebuilt_ || iteration_ == 0 || !rebuild_allowed) {
    return false;
  }
  buckets_rebuilt_ = true;
  // Every rank must bucket identically; rank 0's observed order is the one all use.
  auto order = at::empty({static_cast<int64_t>(parameters_.size())}, at::TensorOptions().dtype(at::kLong));
  if (rank() == 0) {
    // Rank 0 may have observed no complete order (it joined before its first backward): then the
    // current order stands. Either way every rank receives the same permutation.
    std::vector<size_t> proposal = observed_order_;
    if (proposal.size() != parameters_.size()) {
      proposal.clear();
      for (const auto& bucket : buckets_) {
        proposal.insert(proposal.end(), bucket.parameter_indices.begin(), bucket.parameter_indices.end());
      }
    }
    for (const auto i : c10::irange(proposal.size())) {
      order.data_ptr<int64_t>()[i] = static_cast<int64_t>(proposal[i]);
    }
  }
  order = broadcast(*process_group_, order, device());
  std::vector<size_t> agreed(order.data_ptr<int64_t>(), order.data_ptr<int64_t>() + order.numel());
  build_buckets(agreed);
  return true;
}

std::vector<size_t> Reducer::unreachable_parameters(const std::vector<at::Tensor>& outputs) const {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& output : outputs) {
    if (!output.defined() || !output.requires_grad()) {
      continue;
    }
    auto function = torch::autograd::impl::gradient_edge(output).function;
    if (function && seen.insert(function.get()).second) {
      stack.push_back(function.get());
    }
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      if (edge.function && seen.insert(edge.function.get()).second) {
        stack.push_back(edge.function.get());
      }
    }
  }
  std::vector<size_t> unreachable;
  for (const auto i : c10::irange(parameters_.size())) {
    if (!seen.count(gradient_hooks_->accumulator(i))) {
      unreachable.push_back(i);
    }
  }
  return unreachable;
}

bool Reducer::needs_used_map() const {
  return options_.static_graph ? iteration_ == 0 : options_.find_unused_parameters;
}

void Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (armed_ && backward_started_) {
    // The last backward raised before its end-of-backward callback: wait for what it launched, so no
    // collective still writes into the buckets, and say that the ranks may now be out of step.
    armed_ = false;
    const auto error = wait_for_buckets();
    TORCH_CHECK(
        false, "DistributedDataParallel (rank ", rank(),
        "): the previous backward stopped before all gradient buckets were reduced",
        error.empty() ? "" : " (" + error + ")",
        "; this rank's collectives may no longer match the other ranks'. Every rank must finish every "
        "synchronised backward (skipping a batch on one rank needs no_sync on all).");
  }
  armed_ = true;
  backward_started_ = false;
  ready_.assign(parameters_.size(), false);
  next_bucket_to_launch_ = 0;
  for (auto& bucket : buckets_) {
    bucket.pending = bucket.parameter_indices.size();
    bucket.future.reset();
  }
  if (iteration_ == 0) {
    observed_order_.clear();  // only a complete first backward's order counts
  }
  if (needs_used_map()) {
    unused_ = unreachable_parameters(outputs);
  } else {
    unused_ = static_unused_;
  }
}

void Reducer::on_gradient_accumulated(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Recorded under no_sync too: a gradient accumulated there is this rank's contribution to the next
  // synchronised step even if that step's forward leaves the parameter unused (torch does the same).
  if (parameters_[index].grad().defined()) {
    locally_used_.data_ptr<int32_t>()[index] = 1;
  }
  if (!armed_) {
    return;  // no_sync, or a backward of a forward that did not go through DDP
  }
  if (!backward_started_) {
    backward_started_ = true;
    backward_began_at_ = std::chrono::system_clock::now();
    torch::autograd::Engine::get_default_engine().queue_callback([this] {
      std::lock_guard<std::mutex> lock(mutex_);
      finalize_backward();
    });
    for (size_t unused : unused_) {
      mark_ready(unused, /*produced_by_autograd=*/false);
    }
  }
  mark_ready(index, /*produced_by_autograd=*/true);
}

void Reducer::mark_ready(size_t index, bool produced_by_autograd) {
  TORCH_CHECK(
      !ready_[index], "DistributedDataParallel (rank ", rank(), "): parameter ", names_[index],
      " was marked ready twice in one backward. ",
      produced_by_autograd && options_.find_unused_parameters
          ? "find_unused_parameters marked it unused, yet autograd produced its gradient: were the forward's "
            "outputs not all returned from forward?"
          : "A reentrant backward (activation checkpointing with use_reentrant=True) or a parameter shared "
            "by two DDP instances causes this; neither is supported.");
  ready_[index] = true;
  if (iteration_ == 0 && !buckets_rebuilt_) {
    observed_order_.push_back(index);
  }
  const auto& location = locations_[index];
  auto& bucket = buckets_[location.bucket];
  auto& view = bucket.views[location.slot];
  auto& grad = parameters_[index].mutable_grad();
  const bool average_here = comm_hook_ == nullptr;  // a hook receives raw sums and averages itself
  bucket.inputs[location.slot] = view;
  bucket.reduced_in_gradient[location.slot] = false;
  if (!grad.defined()) {
    view.zero_();
    launch_if_full(location.bucket);
    return;
  }
  TORCH_CHECK(
      grad.layout() == c10::kStrided, "DistributedDataParallel: parameter ", names_[index],
      " has a sparse gradient; torchpar's reducer handles dense gradients only");
  if (reducing_in_place()) {
    // A gradient kept from before for a parameter unused now is not this backward's to change.
    if (produced_by_autograd && grad.is_contiguous() && !grad.requires_grad() &&
        grad.scalar_type() == view.scalar_type()) {
      bucket.inputs[location.slot] = grad;
      bucket.reduced_in_gradient[location.slot] = true;
    } else {
      view.copy_(grad.detach());  // averaged by the all-reduce (AVG)
    }
  } else if (grad.is_alias_of(view)) {
    if (average_here) {
      view.mul_(average_scale_);
    }
  } else {
    // detach: with backward(create_graph=true) the gradient requires grad, which out= refuses.
    if (average_here) {
      at::mul_out(view, grad.detach(), average_scale_);
    } else {
      view.copy_(grad.detach());
    }
    if (options_.gradient_as_bucket_view) {
      grad = view;
    }
  }
  launch_if_full(location.bucket);
}

void Reducer::launch_if_full(size_t bucket_index) {
  auto& bucket = buckets_[bucket_index];
  if (--bucket.pending == 0) {
    if (timeline_) {
      timeline_->instant("bucket " + std::to_string(bucket_index) + " ready", "backward");
    }
    launch_ready_buckets();
  }
}

void Reducer::launch_ready_buckets() {
  // Collectives must be issued in the same order on every rank, whatever order gradients arrive in.
  while (next_bucket_to_launch_ < buckets_.size() && buckets_[next_bucket_to_launch_].pending == 0) {
    auto& bucket = buckets_[next_bucket_to_launch_];
    bucket.future = reducing_in_place() ? reduce_in_place(next_bucket_to_launch_, bucket.inputs)
                                        : communicate(next_bucket_to_launch_, bucket.flat);
    ++next_bucket_to_launch_;
  }
}

c10::intrusive_ptr<c10::ivalue::Future> Reducer::reduce_in_place(size_t bucket_index, std::vector<at::Tensor> tensors) {
  const auto launched_at = std::chrono::system_clock::now();
  c10d::AllreduceCoalescedOptions average;
  average.reduceOp = c10d::ReduceOp::AVG;
  auto work = options_.data_process_group->allreduce_coalesced(tensors, average);
  works_.resize(buckets_.size());
  works_[bucket_index] = work;
  return traced(bucket_index, launched_at, work->getFuture());
}

c10::intrusive_ptr<c10::ivalue::Future> Reducer::traced(size_t bucket_index,
                                                        std::chrono::system_clock::time_point launched_at,
                                                        c10::intrusive_ptr<c10::ivalue::Future> future) {
  if (timeline_) {
    future->addCallback([timeline = timeline_, bucket_index, launched_at](c10::ivalue::Future&) {
      timeline->span("allreduce bucket " + std::to_string(bucket_index), "communication", launched_at);
    });
  }
  return future;
}

c10::intrusive_ptr<c10::ivalue::Future> Reducer::communicate(size_t bucket_index, at::Tensor buffer) {
  const auto& bucket = buckets_[bucket_index];
  const auto launched_at = std::chrono::system_clock::now();
  c10::intrusive_ptr<c10::ivalue::Future> future;
  if (comm_hook_) {
    std::vector<c10::IntArrayRef> sizes(bucket.sizes.begin(), bucket.sizes.end());
    std::vector<at::Tensor> parameters;
    for (size_t index : bucket.parameter_indices) {
      parameters.push_back(parameters_[index]);
    }
    c10d::GradBucket grad_bucket(
        bucket_index, buckets_.size(), std::move(buffer), bucket.offsets, bucket.lengths, std::move(sizes),
        std::move(parameters), std::nullopt);
    future = comm_hook_->runHook(grad_bucket);
    TORCH_CHECK(future, "DistributedDataParallel: the communication hook returned no future for bucket ", bucket_index);
  } else {
    std::vector<at::Tensor> tensors{std::move(buffer)};
    auto work = options_.data_process_group->allreduce(tensors);
    works_.resize(buckets_.size());
    works_[bucket_index] = work;
    future = work->getFuture();
  }
  return traced(bucket_index, launched_at, std::move(future));
}

at::Tensor Reducer::reduced_result(size_t bucket_index, const c10::intrusive_ptr<c10::ivalue::Future>& future) {
  if (bucket_index < works_.size() && works_[bucket_index]) {
    // Waited on as a work too: the shm backend then drops the op's hold on its tensors here (shm_work.h), where
    // it would otherwise keep the last bucket's gradients until the next op, past zero_grad.
    const auto work = std::move(works_[bucket_index]);
    try {
      work->wait();
    } catch (const std::exception&) {
      // the future, below, carries the error
    }
  }
  future->wait();
  if (future->hasError()) {
    const auto& bucket = buckets_[bucket_index];
    TORCH_CHECK(
        false, peers_.explain(c10::str("the all-reduce of gradient bucket ", bucket_index, " (",
                                       describe(bucket.parameter_indices), ") failed: ",
                                       future->tryRetrieveErrorMessage())));
  }
  if (!comm_hook_) {
    return {};
  }
  return comm_hook_->parseHookResult(future->value());
}

std::string Reducer::wait_for_buckets() {
  std::string first_error;
  for (const auto b : c10::irange(buckets_.size())) {
    auto& bucket = buckets_[b];
    if (!bucket.future) {
      continue;
    }
    auto future = std::move(bucket.future);
    bucket.future.reset();
    try {
      const auto result = reduced_result(b, future);
      if (result.defined() && !result.is_same(bucket.flat)) {
        TORCH_CHECK(
            result.numel() == bucket.flat.numel(), "the communication hook returned ", result.numel(),
            " elements for bucket ", b, ", which holds ", bucket.flat.numel());
        bucket.flat.copy_(result.view_as(bucket.flat));
      }
    } catch (const c10::Error& error) {
      // Keep waiting for the other buckets: none may still be in flight when this returns.
      if (first_error.empty()) {
        first_error = error.what_without_backtrace();
      }
    }
  }
  return first_error;
}

at::Tensor Reducer::all_reduce_used_map(at::Tensor used) {
  try {
    return all_reduce_sum(*process_group_, used, device()).gt(0);
  } catch (const std::exception& error) {
    TORCH_CHECK(false, peers_.explain(c10::str("DistributedDataParallel (rank ", rank(),
                                               "): the all-reduce of the used-parameter map failed: ", message_of(error))));
  }
}

void Reducer::finalize_backward() {
  armed_ = false;
  std::vector<size_t> missing;
  for (const auto i : c10::irange(parameters_.size())) {
    if (!ready_[i]) {
      missing.push_back(i);
    }
  }
  // Buckets already launched are waited for even on error, so no collective is left half-issued.
  const auto communication_error = wait_for_buckets();
  TORCH_CHECK(communication_error.empty(), "DistributedDataParallel (rank ", rank(), "): ", communication_error);
  TORCH_CHECK(
      missing.empty(), "DistributedDataParallel (rank ", rank(),
      "): backward finished, but these parameters received no gradient: ", describe(missing),
      ". Their buckets were never all-reduced. If parts of the model are legitimately unused in some "
      "iterations, construct DistributedDataParallel with find_unused_parameters=true (or static_graph=true "
      "when the same parameters are unused every iteration); otherwise make sure every output of forward "
      "contributes to the loss.");
  at::Tensor globally_used;
  const auto locally_used = locally_used_.clone();
  locally_used_.zero_();
  if (needs_used_map()) {
    globally_used = all_reduce_used_map(locally_used);
    if (options_.static_graph) {
      static_unused_ = unused_;
      static_globally_used_ = globally_used;
    }
  } else if (options_.static_graph) {
    globally_used = static_globally_used_;
  }
  write_back_gradients(globally_used);
  for (auto& bucket : buckets_) {
    bucket.inputs = bucket.views;  // holds no gradient past the step: zero_grad(set_to_none) frees them
  }
  if (timeline_) {
    timeline_->span("backward", "backward", backward_began_at_);
  }
  ++iteration_;
}

void Reducer::write_back_gradients(const at::Tensor& globally_used) {
  for (const auto i : c10::irange(parameters_.size())) {
    if (globally_used.defined() && !globally_used.data_ptr<bool>()[i]) {
      continue;  // no rank used it: its .grad stays as it was, as in single-process training
    }
    const auto& location = locations_[i];
    if (buckets_[location.bucket].reduced_in_gradient[location.slot]) {
      continue;  // averaged where it lies
    }
    const auto& view = buckets_[location.bucket].views[location.slot];
    auto& grad = parameters_[i].mutable_grad();
    if (options_.gradient_as_bucket_view) {
      if (!grad.defined() || !grad.is_alias_of(view)) {
        grad = view;
      }
    } else if (!grad.defined()) {
      grad = view.clone();
    } else {
      grad.copy_(view);
    }
  }
}

void Reducer::shadow_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
  for (const auto b : c10::irange(buckets_.size())) {
    auto zeros = at::zeros_like(buckets_[b].flat);
    futures.push_back(reducing_in_place() ? reduce_in_place(b, {zeros}) : communicate(b, zeros));
  }
  for (const auto b : c10::irange(buckets_.size())) {
    try {
      reduced_result(b, futures[b]);
    } catch (const c10::Error& error) {
      TORCH_CHECK(false, "DistributedDataParallel join (rank ", rank(), "): ", error.what_without_backtrace());
    }
  }
  if (needs_used_map()) {
    auto used = all_reduce_used_map(at::zeros_like(locally_used_));
    if (options_.static_graph) {
      static_globally_used_ = used;
    }
  }
  ++iteration_;
}

std::string Reducer::describe(const std::vector<size_t>& indices) const {
  constexpr size_t kMaxNamed = 10;
  std::ostringstream text;
  for (const auto k : c10::irange(std::min(indices.size(), kMaxNamed))) {
    text << (k ? ", " : "") << names_[indices[k]];
  }
  if (indices.size() > kMaxNamed) {
    text << " and " << indices.size() - kMaxNamed << " more";
  }
  return text.str();
}

} // namespace torchpar::ddp
