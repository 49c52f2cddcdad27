#include <torchpar/sharded/sharded_coordinator.h>

#include <torchpar/common/bucket_assignment.h>
#include <torchpar/common/control_collectives.h>
#include <torchpar/common/gradient_hooks.h>
#include <torchpar/comm/process_group.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <unordered_map>

namespace torchpar::sharded {
namespace {

// The model's state broadcast at construction, and the buffers before each forward, go in flat copies of at most
// this (or one tensor): at torch DDP's 250 MiB, wrapping a model for stage 3 held a copy of it whole beside it
// (deep MLP of 8 MiB on 4 ranks: a 15.8 MiB peak, against 10.3 for wrapping and training).
constexpr size_t kBroadcastBucketBytes = 1u << 20;

// The base-tensor collectives under their pre-2.13 names, which every supported torch has.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
c10::intrusive_ptr<c10d::Work> reduce_scatter(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input) {
  return group._reduce_scatter_base(output, input, c10d::ReduceScatterOptions{});
}
c10::intrusive_ptr<c10d::Work> all_gather(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input) {
  return group._allgather_base(output, input, c10d::AllgatherOptions{});
}
#pragma GCC diagnostic pop

// The unit (1 + index into `units`) of the longest unit name `name` starts with, or 0: the root.
int unit_of_name(const std::vector<std::string>& units, const std::string& name) {
  int best = 0;
  size_t best_length = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    const auto& prefix = units[u];
    const bool inside = name.size() > prefix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
                        name[prefix.size()] == '.';
    if (inside && prefix.size() >= best_length) {
      best = static_cast<int>(u) + 1;
      best_length = prefix.size();
    }
  }
  return best;
}

} // namespace

ShardedCoordinator::ShardedCoordinator(NamedTensors parameters, NamedTensors buffers, ShardedOptions options)
    : buffers_(std::move(buffers)), options_(std::move(options)) {
  TORCH_CHECK(options_.process_group(),
              "ShardedDataParallel: no process group; set ShardedOptions::process_group to the group "
              "torchpar::init_process_group returned");
  TORCH_CHECK(options_.stage() >= 1 && options_.stage() <= 3, "ShardedDataParallel: stage ", options_.stage(),
              " does not exist; stages 1 (optimizer state), 2 (and gradients) and 3 (and parameters) do");
  TORCH_CHECK(options_.stage() == 3 || options_.units().empty(), "ShardedDataParallel: units are stage 3's; stage ",
              options_.stage(), " keeps the parameters whole");
  TORCH_CHECK(options_.bucket_cap_mb() > 0 && options_.first_bucket_cap_mb() > 0,
              "ShardedDataParallel: bucket_cap_mb and first_bucket_cap_mb must be > 0, got ", options_.bucket_cap_mb(),
              " and ", options_.first_bucket_cap_mb());
  auto& group = *options_.process_group();
  // A tensor two modules share (tied weights) is one parameter: its gradient already sums both uses.
  std::unordered_map<const void*, size_t> index_of;
  NamedTensors distinct;
  std::vector<int> unit_of;
  units_ = static_cast<int>(options_.units().size()) + 1;
  for (auto& [name, parameter] : parameters) {
    const int unit = unit_of_name(options_.units(), name);
    const auto [known, added] = index_of.emplace(parameter.unsafeGetTensorImpl(), parameters_.size());
    if (!added) {
      // A tied parameter whose names fall in different units belongs to the root, which holds it throughout.
      if (known->second != SIZE_MAX && unit_of[known->second] != unit) unit_of[known->second] = 0;
      continue;
    }
    distinct.emplace_back(name, parameter);
    if (parameter.requires_grad()) {
      parameters_.push_back(parameter);
      names_.push_back(name);
      unit_of.push_back(unit);
    } else {
      index_of[parameter.unsafeGetTensorImpl()] = SIZE_MAX;
    }
  }
  TORCH_CHECK(!parameters_.empty(),
              "ShardedDataParallel is not needed when a module doesn't have any parameter that requires a gradient");
  for (int unit = 1; unit < units_; ++unit) {
    TORCH_CHECK(std::count(unit_of.begin(), unit_of.end(), unit) > 0, "ShardedDataParallel: unit '",
                options_.units()[unit - 1], "' holds no trained parameter of its own: no module of that name, or "
                "a nested unit or the root (tied weights) took them all");
  }
  const at::Device device = parameters_.front().device();
  check_same_model(group, distinct, buffers_, device, "ShardedDataParallel");
  peers_ = PeerProcesses::gather(group, device);
  prefetch_ = options_.prefetch().value_or(device.is_cuda());
  {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> state;
    for (const auto& entry : distinct) state.push_back(entry.second);
    for (const auto& entry : buffers_) state.push_back(entry.second);
    c10d::broadcast_coalesced(options_.process_group(), state, kBroadcastBucketBytes, 0);
  }

  std::vector<int64_t> numels;
  std::vector<c10::ScalarType> dtypes;
  for (const auto& parameter : parameters_) {
    numels.push_back(parameter.numel());
    dtypes.push_back(parameter.scalar_type());
  }
  const auto mebibytes = [](double mib) { return static_cast<size_t>(mib * (1 << 20)); };
  layout_ = options_.stage() == 3
                ? build_unit_layout(numels, dtypes, unit_of, units_, group.getSize())
                : build_shard_layout(numels, dtypes, reverse_registration_order(parameters_.size()),
                                     first_and_later_caps(mebibytes(options_.first_bucket_cap_mb()),
                                                          mebibytes(options_.bucket_cap_mb())),
                                     group.getSize());
  {
    // Scoped: these aliases would keep the original storages alive beside the flat tensors made below.
    std::vector<at::Tensor> values;
    for (const auto& parameter : parameters_) values.push_back(parameter.detach());
    for (size_t shard = 0; shard < layout_.shards.size(); ++shard) {
      shard_.push_back(shard_of(shard, values));
    }
  }
  for (auto& shard : shard_) shard.set_requires_grad(true);
  if (options_.param_dtype()) {
    // The model computes in the policy's dtype; the shard, cut above from the original values, is the master.
    TORCH_CHECK(c10::isFloatingType(*options_.param_dtype()), "ShardedDataParallel: param_dtype must be a "
                "floating-point dtype, got ", *options_.param_dtype());
    at::NoGradGuard no_grad;
    for (auto& entry : distinct) {
      auto& parameter = entry.second;
      if (c10::isFloatingType(parameter.scalar_type()) && (options_.stage() < 3 || !parameter.requires_grad())) {
        parameter.set_data(parameter.detach().to(*options_.param_dtype()));
      }
    }
  }
  {
    // Each bucket's parameters become views of one flat tensor (in the compute dtype), which the all-gather fills
    // in place (no gathered copy to allocate, copy out and free). At stage 3 its storage comes and goes, the values
    // being in the shard meanwhile.
    at::NoGradGuard no_grad;
    const bool sharded_parameters = options_.stage() == 3;
    for (size_t b = 0; b < layout_.buckets.size(); ++b) {
      const auto& bucket = layout_.buckets[b];
      const auto options = shard_.front().options().dtype(compute_dtype(bucket.dtype)).requires_grad(false);
      auto flat = sharded_parameters ? at::empty({bucket.padded_numel}, options)
                                     : at::zeros({bucket.padded_numel}, options);
      for (const auto& slot : bucket.slots) {
        auto& parameter = parameters_[slot.parameter];
        auto view = flat.narrow(0, slot.offset, slot.numel).view(parameter.sizes());
        if (!sharded_parameters) view.copy_(parameter.detach());  // stage 3's values are in the shard
        parameter.set_data(view);  // the original storage is freed here
      }
      unsharded_.push_back(flat);
      gathered_.push_back(true);
      gathering_.emplace_back();
      if (sharded_parameters) release_bucket(b);  // one bucket allocated at a time while they are made
    }
  }
  ready_.assign(parameters_.size(), false);
  pending_.assign(layout_.buckets.size(), 0);
  hooks_ = std::make_unique<GradientReadyHooks>(parameters_, [this](size_t index) { on_gradient_ready(index); });
}

ShardedCoordinator::~ShardedCoordinator() = default;

bool ShardedCoordinator::will_sync() const {
  return grad_sync_ && at::GradMode::is_enabled();
}

void ShardedCoordinator::pre_forward(bool will_sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(in_flight_.empty(), "ShardedDataParallel: a forward began while the previous backward's gradients "
              "were still being reduced (did that backward fail?)");
  if (will_sync && options_.broadcast_buffers() && !buffers_.empty()) {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> buffers;
    for (const auto& entry : buffers_) buffers.push_back(entry.second);
    c10d::broadcast_coalesced(options_.process_group(), buffers, kBroadcastBucketBytes, 0);
  }
  if (will_sync) bytes_sent_ = 0;
  if (options_.stage() == 3) {
    for_buckets_of(0, &ShardedCoordinator::gather_bucket);
    prefetch(1);
  }
  armed_ = will_sync;
  backward_started_ = false;
  ready_.assign(parameters_.size(), false);
  for (size_t b = 0; b < layout_.buckets.size(); ++b) pending_[b] = layout_.buckets[b].slots.size();
  next_bucket_ = 0;
}

void ShardedCoordinator::on_gradient_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!armed_) return;  // no_sync, or a forward that did not go through the wrapper
  if (!backward_started_) {
    backward_started_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
  }
  TORCH_CHECK(!ready_[index], "ShardedDataParallel: parameter ", names_[index],
              " got its gradient twice in one backward (a reentrant checkpoint, or a second backward through the "
              "same forward without a forward in between)");
  ready_[index] = true;
  --pending_[layout_.location[index].first];
  launch_ready_buckets();
}

void ShardedCoordinator::launch_ready_buckets() {
  // In bucket order only, so that every rank issues the same collectives in the same order.
  while (next_bucket_ < layout_.buckets.size() && pending_[next_bucket_] == 0) {
    launch(next_bucket_++);
  }
}

void ShardedCoordinator::launch(size_t index) {
  if (options_.stage() == 3) {
    release_bucket(index);  // its backward is done: every gradient it computes has arrived; freed before the copy
  }
  const auto& bucket = layout_.buckets[index];
  auto& group = *options_.process_group();
  const auto& first = parameters_[bucket.slots.front().parameter];
  at::Tensor input =
      at::empty({bucket.padded_numel}, first.options().dtype(reduce_dtype(bucket.dtype)).requires_grad(false));
  int64_t filled = 0;
  for (const auto& slot : bucket.slots) {
    auto& parameter = parameters_[slot.parameter];
    auto destination = input.narrow(0, slot.offset, slot.numel);
    const auto& grad = parameter.grad();
    if (grad.defined()) {
      TORCH_CHECK(grad.layout() == c10::kStrided, "ShardedDataParallel: parameter ", names_[slot.parameter],
                  " has a sparse gradient; sharded data parallelism handles dense gradients only");
      destination.view_as(grad).copy_(grad);
    } else {
      destination.zero_();  // unused in this backward: it contributes nothing
    }
    if (options_.stage() >= 2) {
      parameter.mutable_grad().reset();  // stages 2 and 3 keep only the shard's part, once reduced
    }
    filled = slot.offset + slot.numel;
  }
  input.narrow(0, filled, bucket.padded_numel - filled).zero_();
  at::Tensor output = at::empty({bucket.piece_numel}, input.options());
  auto work = reduce_scatter(group, output, input);
  bytes_sent_ += bucket.piece_numel * (group.getSize() - 1) * static_cast<int64_t>(input.element_size());
  in_flight_.push_back({index, std::move(input), std::move(output), std::move(work)});
  if (in_flight_.size() > kReductionsInFlight) {
    complete_oldest();
  }
}

void ShardedCoordinator::complete_oldest() {
  InFlight done = std::move(in_flight_.front());
  in_flight_.erase(in_flight_.begin());
  const auto& bucket = layout_.buckets[done.bucket];
  wait_naming_lost(*done.work, "the reduce-scatter of " + describe(bucket));
  auto& shard = shard_[layout_.shard_index(bucket.dtype)];
  at::NoGradGuard no_grad;
  done.output.div_(options_.process_group()->getSize());
  if (!shard.grad().defined()) {
    shard.mutable_grad() = at::zeros_like(shard);
  }
  shard.mutable_grad().narrow(0, bucket.shard_offset, bucket.piece_numel).add_(done.output);
}

void ShardedCoordinator::finish_backward() {
  std::lock_guard<std::mutex> lock(mutex_);
  armed_ = false;
  // Buckets with a parameter this backward did not reach go now, zeros in its place, still in order.
  while (next_bucket_ < layout_.buckets.size()) {
    launch(next_bucket_++);
  }
  while (!in_flight_.empty()) {
    complete_oldest();
  }
  if (options_.stage() == 3) {
    for (size_t b = 0; b < layout_.buckets.size(); ++b) release_bucket(b);  // the root's too
  }
}

void ShardedCoordinator::reduce_gradients() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(options_.stage() <= 2, "ShardedDataParallel: reduce_gradients() is for stages 1 and 2, whose "
              "parameters stay whole; stage 3 gathers them around the forward it runs");
  TORCH_CHECK(!armed_ && in_flight_.empty(), "ShardedDataParallel: reduce_gradients() during a synchronised "
              "backward, which reduces the gradients itself");
  bytes_sent_ = 0;
  for (size_t b = 0; b < layout_.buckets.size(); ++b) launch(b);
  while (!in_flight_.empty()) complete_oldest();
}

void ShardedCoordinator::gather_parameters() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (options_.stage() == 3) {
    // Nothing to send: each unit gathers the new values when it next runs; what is gathered now is stale.
    for (size_t b = 0; b < layout_.buckets.size(); ++b) release_bucket(b);
    return;
  }
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const auto& bucket = layout_.buckets[b];
    bytes_sent_ += all_gather_bucket(bucket, shard_[layout_.shard_index(bucket.dtype)], unsharded_[b]);
  }
}

double ShardedCoordinator::clip_grad_norm(double max_norm, double norm_type) {
  at::NoGradGuard no_grad;
  auto& group = *options_.process_group();
  const at::Device device = shard_.front().device();
  const bool infinity = std::isinf(norm_type);
  at::Tensor local = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (const auto& shard : shard_) {
    if (!shard.grad().defined()) continue;
    const auto grad = shard.grad().to(at::kDouble);
    if (infinity) {
      local = at::maximum(local, grad.abs().max().reshape({1}));
    } else {
      local += grad.abs().pow(norm_type).sum();
    }
  }
  double total;
  if (infinity) {
    std::vector<at::Tensor> tensors{local};
    group.allreduce(tensors, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
    total = local.item<double>();
  } else {
    total = std::pow(all_reduce_sum(group, local, device).item<double>(), 1.0 / norm_type);
  }
  // torch::nn::utils::clip_grad_norm_'s coefficient.
  const double coefficient = std::min(max_norm / (total + 1e-6), 1.0);
  for (auto& shard : shard_) {
    if (shard.grad().defined()) shard.mutable_grad().mul_(coefficient);
  }
  return total;
}

std::vector<std::pair<size_t, at::Tensor>> ShardedCoordinator::gather_full(size_t shard,
                                                                          const at::Tensor& shard_like) const {
  TORCH_CHECK(shard < shard_.size(), "ShardedDataParallel: no shard ", shard, " (there are ", shard_.size(), ")");
  TORCH_CHECK(shard_like.dim() == 1 && shard_like.numel() == shard_[shard].numel(), "ShardedDataParallel: a tensor "
              "of shape ", shard_like.sizes(), " is not shaped like shard ", shard, " (", shard_[shard].numel(), ")");
  at::NoGradGuard no_grad;
  const auto dtype = layout_.shards[shard].first;
  std::vector<std::pair<size_t, at::Tensor>> full;
  for (const auto& bucket : layout_.buckets) {
    if (bucket.dtype != dtype) continue;
    at::Tensor gathered = at::empty({bucket.padded_numel}, shard_like.options());
    all_gather_bucket(bucket, shard_like, gathered);
    for (const auto& slot : bucket.slots) {
      full.emplace_back(slot.parameter,
                        gathered.narrow(0, slot.offset, slot.numel).view(parameters_[slot.parameter].sizes()).clone());
    }
  }
  return full;
}

int ShardedCoordinator::rank() const {
  return options_.process_group()->getRank();
}

at::Tensor ShardedCoordinator::shard_of(size_t shard, const std::vector<at::Tensor>& full) const {
  TORCH_CHECK(shard < layout_.shards.size(), "ShardedDataParallel: no shard ", shard, " (there are ",
              layout_.shards.size(), ")");
  TORCH_CHECK(full.size() == parameters_.size(), "ShardedDataParallel: ", full.size(), " tensors for ",
              parameters_.size(), " trained parameters");
  const auto [dtype, length] = layout_.shards[shard];
  at::Tensor result =
      at::zeros({length}, at::TensorOptions().dtype(dtype).device(parameters_.front().device()));
  for (const auto& piece : pieces_of(layout_, shard, rank())) {
    const auto& whole = full[piece.parameter];
    TORCH_CHECK(whole.numel() == parameters_[piece.parameter].numel(), "ShardedDataParallel: the tensor given for "
                "parameter ", names_[piece.parameter], " has ", whole.numel(), " elements, the parameter ",
                parameters_[piece.parameter].numel());
    result.narrow(0, piece.shard_offset, piece.numel)
        .copy_(whole.detach().reshape(-1).narrow(0, piece.parameter_offset, piece.numel));
  }
  return result;
}

ShardedCoordinator::Gathering ShardedCoordinator::launch_all_gather(const ShardBucket& bucket,
                                                                    const at::Tensor& shard_like,
                                                                    at::Tensor& gathered) const {
  at::NoGradGuard no_grad;
  auto& group = *options_.process_group();
  at::Tensor piece = shard_like.detach()
                         .narrow(0, bucket.shard_offset, bucket.piece_numel)
                         .to(gathered.scalar_type())
                         .contiguous();
  auto work = all_gather(group, gathered, piece);
  return {std::move(work), std::move(piece)};
}

int64_t ShardedCoordinator::all_gather_bucket(const ShardBucket& bucket, const at::Tensor& shard_like,
                                              at::Tensor& gathered) const {
  const auto gathering = launch_all_gather(bucket, shard_like, gathered);
  wait_naming_lost(*gathering.work, "the all-gather of " + describe(bucket));
  return gathered_bytes(bucket, gathering.piece);
}

int64_t ShardedCoordinator::gathered_bytes(const ShardBucket& bucket, const at::Tensor& piece) const {
  return bucket.piece_numel * (options_.process_group()->getSize() - 1) * static_cast<int64_t>(piece.element_size());
}

void ShardedCoordinator::start_gather(size_t index) {
  if (gathered_[index]) return;
  const auto& bucket = layout_.buckets[index];
  auto& flat = unsharded_[index];
  auto* storage = flat.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(bucket.padded_numel) * flat.element_size();
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
  auto gathering = launch_all_gather(bucket, shard_[layout_.shard_index(bucket.dtype)], flat);
  bytes_sent_ += gathered_bytes(bucket, gathering.piece);
  gathering_[index] = std::move(gathering);
  gathered_[index] = true;
}

void ShardedCoordinator::finish_gather(size_t index) {
  if (!gathering_[index]) return;
  const auto gathering = std::move(*gathering_[index]);
  gathering_[index].reset();
  wait_naming_lost(*gathering.work, "the all-gather of " + describe(layout_.buckets[index]));
}

void ShardedCoordinator::gather_bucket(size_t index) {
  start_gather(index);
  finish_gather(index);
}

void ShardedCoordinator::prefetch(int unit) {
  if (prefetch_ && unit >= 1 && unit < units_) for_buckets_of(unit, &ShardedCoordinator::start_gather);
}

void ShardedCoordinator::release_bucket(size_t index) {
  if (!gathered_[index]) return;
  finish_gather(index);  // every rank takes part in a gather it started, needed or not
  auto* storage = unsharded_[index].storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, unsharded_[index].device()));
  storage->set_nbytes(0);
  gathered_[index] = false;
}

void ShardedCoordinator::for_buckets_of(int unit, void (ShardedCoordinator::*action)(size_t)) {
  TORCH_CHECK(options_.stage() == 3, "ShardedDataParallel: units are stage 3's; this model is at stage ",
              options_.stage());
  TORCH_CHECK(unit >= 0 && unit < units_, "ShardedDataParallel: no unit ", unit, " (there are ", units_, ")");
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    if (layout_.buckets[b].unit == unit) (this->*action)(b);
  }
}

void ShardedCoordinator::before_unit_forward(int unit) {
  std::lock_guard<std::mutex> lock(mutex_);
  for_buckets_of(unit, &ShardedCoordinator::gather_bucket);
  prefetch(unit + 1);
}

void ShardedCoordinator::after_unit_forward(int unit) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (options_.reshard_after_forward() && unit != 0) {
    for_buckets_of(unit, &ShardedCoordinator::release_bucket);
  }
}

void ShardedCoordinator::before_unit_backward(int unit) {
  std::lock_guard<std::mutex> lock(mutex_);
  for_buckets_of(unit, &ShardedCoordinator::gather_bucket);
  prefetch(unit - 1);
}

void ShardedCoordinator::gather_before_backward_of(int unit, at::Tensor& output) {
  if (output.requires_grad()) {
    output.register_hook([this, unit](const at::Tensor&) { before_unit_backward(unit); });
  }
}

std::string ShardedCoordinator::describe(const ShardBucket& bucket) const {
  if (bucket.unit > 0) return "unit '" + options_.units()[bucket.unit - 1] + "'";
  if (bucket.unit == 0) return "the root unit";
  std::string names;
  for (const auto& slot : bucket.slots) names += (names.empty() ? "" : ", ") + names_[slot.parameter];
  return "the bucket of " + names;
}

void ShardedCoordinator::wait_naming_lost(c10d::Work& work, const std::string& what) const {
  try {
    work.wait();
  } catch (const std::exception& error) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
    TORCH_CHECK(false, peers_.explain(c10::str("ShardedDataParallel (rank ", options_.process_group()->getRank(),
                                               "): ", what, " failed: ",
                                               c10_error ? c10_error->what_without_backtrace() : error.what())));
  }
}

std::string ShardedCoordinator::unit_of(size_t parameter) const {
  TORCH_CHECK(parameter < parameters_.size(), "ShardedDataParallel: no trained parameter ", parameter);
  return describe(layout_.buckets[layout_.location[parameter].first]);
}

bool ShardedCoordinator::parameter_gathered(size_t parameter) const {
  TORCH_CHECK(parameter < parameters_.size(), "ShardedDataParallel: no trained parameter ", parameter);
  const size_t bucket = layout_.location[parameter].first;
  return options_.stage() < 3 || (gathered_[bucket] && !gathering_[bucket]);
}

void ShardedCoordinator::gather_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int unit = 0; unit < units_; ++unit) for_buckets_of(unit, &ShardedCoordinator::gather_bucket);
}

void ShardedCoordinator::release_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int unit = 0; unit < units_; ++unit) for_buckets_of(unit, &ShardedCoordinator::release_bucket);
}

c10::ScalarType ShardedCoordinator::compute_dtype(c10::ScalarType dtype) const {
  return options_.param_dtype() && c10::isFloatingType(dtype) ? *options_.param_dtype() : dtype;
}

c10::ScalarType ShardedCoordinator::reduce_dtype(c10::ScalarType dtype) const {
  return options_.reduce_dtype() && c10::isFloatingType(dtype) ? *options_.reduce_dtype() : compute_dtype(dtype);
}

void ShardedCoordinator::zero_parameter_gradients() {
  for (auto& parameter : parameters_) {
    parameter.mutable_grad().reset();
  }
}

ShardedOptions through_same_host_group(ShardedOptions options, const std::vector<at::Tensor>& parameters) {
  const bool on_cpu = !parameters.empty() && parameters.front().device().is_cpu();
  if (on_cpu && options.process_group()) {
    if (auto beside = comm::shm_group_beside(options.process_group())) options.process_group(std::move(beside));
  }
  return options;
}

} // namespace torchpar::sharded
