#include <torchpar/pipeline/pipeline.h>

#include <torchpar/pipeline/layer_profile.h>
#include <torchpar/pipeline/microbatches.h>
#include <torchpar/pipeline/p2p.h>
#include <torchpar/pipeline/partition.h>
#include <torchpar/pipeline/replica_gradients.h>
#include <torchpar/pipeline/shared_gradients.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace torchpar::pipeline {
namespace {

using StageMicrobatch = std::pair<int, int>;

template <typename Map>
auto take(Map& map, const StageMicrobatch& key, const char* what) {
  auto found = map.find(key);
  TORCH_INTERNAL_ASSERT(found != map.end(), "pipeline runtime: no ", what, " for stage ", key.first,
                        ", micro-batch ", key.second);
  auto value = std::move(found->second);
  map.erase(found);
  return value;
}

// Pipeline rank 0 computes the costs and every rank adopts them, replicas included (they are
// passed on from replica 0), so every rank cuts the model the same way even when measured times differ.
std::vector<double> from_rank_zero(c10d::ProcessGroup& group, c10d::ProcessGroup* replicas, size_t count,
                                   const std::function<std::vector<double>()>& compute) {
  auto values = at::zeros({static_cast<int64_t>(count)}, at::kDouble);
  if (group.getRank() == 0) {
    auto costs = compute();
    std::copy(costs.begin(), costs.end(), values.data_ptr<double>());
  }
  std::vector<at::Tensor> buffer{values};
  group.broadcast(buffer)->wait();
  if (replicas) {
    replicas->broadcast(buffer)->wait();
  }
  return {values.data_ptr<double>(), values.data_ptr<double>() + count};
}

Tensors stage_inputs(const Tensors& received, bool first_stage) {
  Tensors leaves;
  for (const auto& tensor : received) {
    const bool differentiable = !first_stage && carries_gradient({tensor.scalar_type(), {}});
    leaves.push_back(differentiable ? tensor.detach().requires_grad_(true) : tensor);
  }
  return leaves;
}

// Every rank must agree on where messages live: on the GPU exactly when the group's default
// backend is NCCL (a rank whose stages hold no parameters cannot tell from its own).
c10::Device message_device(const c10d::ProcessGroup& group) {
  return group.getBackendType() == c10d::ProcessGroup::BackendType::NCCL ? c10::Device(c10::kCUDA)
                                                                          : c10::Device(c10::kCPU);
}

} // namespace

Pipeline::Pipeline(std::vector<LayerFactory> factories, LossFn loss, PipelineOptions options)
    : options_(std::move(options)) {
  auto shared = options_.shared_parameters();
  build(std::move(factories), std::move(loss), std::move(shared));
}

Pipeline::Pipeline(const std::vector<Layer>& layers, LossFn loss, PipelineOptions options)
    : options_(std::move(options)) {
  std::vector<LayerFactory> factories;
  for (const auto& layer : layers) {
    factories.push_back([layer] { return layer; });
  }
  build(std::move(factories), std::move(loss), shared_parameters_of(layers, options_.shared_parameters()));
}

Pipeline::~Pipeline() = default;

void Pipeline::plan_partition(const std::vector<LayerFactory>& factories) {
  const auto layers = static_cast<int64_t>(factories.size());
  const int64_t stages = spec_.stages();
  auto& group = *options_.process_group();
  auto* replicas = options_.data_parallel_group() ? options_.data_parallel_group().get() : nullptr;
  std::vector<double> costs(layers, 1.0);
  std::string unit = "layers";
  if (!options_.balance().empty()) {
    balance_ = options_.balance();
    check_partition(balance_, layers, stages);
  } else if (options_.balance_by() == "uniform") {
    balance_ = uniform_partition(layers, stages);
  } else if (options_.balance_by() == "parameters") {
    costs = from_rank_zero(group, replicas, layers, [&] { return count_layer_parameters(factories); });
    unit = "parameters";
    balance_ = balanced_partition(costs, stages);
  } else if (options_.balance_by() == "time") {
    TORCH_CHECK(group.getRank() != 0 || !options_.sample_input().empty(),
                "pipeline balance_by=\"time\" needs sample_input (one micro-batch of inputs) on rank 0");
    costs = from_rank_zero(group, replicas, layers, [&] { return measure_layer_milliseconds(factories, options_.sample_input()); });
    unit = "ms";
    balance_ = balanced_partition(costs, stages);
  } else {
    TORCH_CHECK(false, "pipeline: balance_by must be \"uniform\", \"parameters\" or \"time\", got \"",
                options_.balance_by(), "\"");
  }
  partition_report_ = describe_partition(balance_, costs, unit);
  if (rank_ == 0) {
    LOG(INFO) << "torchpar pipeline partition (" << layers << " layers, " << stages << " stages, by "
              << (options_.balance().empty() ? options_.balance_by() : "explicit balance") << "):\n"
              << partition_report_;
  }
}

void Pipeline::build(std::vector<LayerFactory> factories, LossFn loss, std::vector<SharedParameterGroup> shared) {
  TORCH_CHECK(options_.process_group(), "pipeline: PipelineOptions.process_group is required");
  TORCH_CHECK(loss, "pipeline: a loss function is required (it runs on the last stage)");
  auto& group = *options_.process_group();
  rank_ = group.getRank();
  spec_.kind = parse_schedule(options_.schedule());
  spec_.ranks = group.getSize();
  spec_.microbatches = options_.microbatches();
  spec_.virtual_stages = options_.virtual_stages();
  check_schedule(spec_);
  TORCH_CHECK(spec_.microbatches <= kMaxMicrobatches, "pipeline: at most ", kMaxMicrobatches,
              " micro-batches per step, got ", spec_.microbatches);
  const bool nccl = group.getBackendType() == c10d::ProcessGroup::BackendType::NCCL;
  // NCCL pairs messages by posting order on one stream per pair, and in GPipe and interleaved 1F1B
  // the two ends of a pair post activations and gradients in different orders.
  TORCH_CHECK(!nccl || spec_.kind == ScheduleKind::OneFOneB || spec_.kind == ScheduleKind::ZeroBubbleH1,
              "pipeline schedule ", schedule_name(spec_.kind), " is not supported on NCCL yet (1f1b and zero_bubble "
              "are); use backend gloo, or cpu:gloo,cuda:gloo");
  shared = merge_shared_parameters(std::move(shared), static_cast<int64_t>(factories.size()));
  plan_partition(factories);
  actions_ = rank_actions(spec_, rank_);

  const auto boundaries = stage_boundaries(balance_);
  const bool split = spec_.kind == ScheduleKind::ZeroBubbleH1;
  for (int stage = rank_; stage < spec_.stages(); stage += spec_.ranks) {
    std::vector<Layer> layers;
    for (int64_t layer = boundaries[stage]; layer < boundaries[stage + 1]; ++layer) {
      layers.push_back(factories[layer]());
    }
    const bool last = stage == spec_.stages() - 1;
    stages_.push_back(std::make_unique<PipelineStage>(stage, static_cast<int>(boundaries[stage]), std::move(layers),
                                                      options_.checkpoint_activations(), split,
                                                      last ? loss : LossFn()));
  }
  const c10::Device device = message_device(group);
  links_ = std::make_unique<StageLinks>(options_.process_group(), device);
  peers_ = PeerProcesses::gather(group, device);
  if (!shared.empty()) {
    std::map<int64_t, const Layer*> local_layers;
    for (const auto& stage : stages_) {
      for (size_t layer = 0; layer < stage->layers().size(); ++layer) {
        local_layers[stage->first_layer() + static_cast<int64_t>(layer)] = &stage->layers()[layer];
      }
    }
    shared_gradients_ = std::make_unique<SharedGradients>(options_.process_group(), std::move(shared), boundaries,
                                                          local_layers, device);
    if (rank_ == 0) {
      LOG(INFO) << "torchpar pipeline: tied parameters\n" << shared_gradients_->report();
    }
  }
  auto replica_lists = collect_parameters();
  if (options_.data_parallel_group() && options_.data_parallel_group()->getSize() > 1) {
    replica_gradients_ = std::make_unique<ReplicaGradients>(options_.data_parallel_group(), std::move(replica_lists),
                                                            options_.bucket_cap_mb());
  }
}

std::vector<std::vector<at::Tensor>> Pipeline::collect_parameters() {
  std::unordered_map<const void*, int> holding_stages;
  for (const auto& stage : stages_) {
    std::unordered_set<const void*> in_stage;
    for (const auto& parameter : stage->parameters()) {
      if (in_stage.insert(parameter.unsafeGetTensorImpl()).second) {
        ++holding_stages[parameter.unsafeGetTensorImpl()];
      }
    }
  }
  std::vector<std::vector<at::Tensor>> lists(stages_.size() + 1);
  std::unordered_set<const void*> listed;
  for (size_t s = 0; s < stages_.size(); ++s) {
    for (const auto& parameter : stages_[s]->parameters()) {
      const void* impl = parameter.unsafeGetTensorImpl();
      if ((shared_gradients_ && shared_gradients_->is_redundant_copy(parameter)) || !listed.insert(impl).second) {
        continue;
      }
      parameters_.push_back(parameter);
      const bool late = holding_stages[impl] > 1 || (shared_gradients_ && shared_gradients_->is_shared(parameter));
      lists[late ? stages_.size() : s].push_back(parameter);
    }
  }
  late_replica_gradients_ = !lists.back().empty();
  if (!late_replica_gradients_) {
    lists.pop_back();
  }
  return lists;
}

std::vector<SharedParameterGroup> Pipeline::shared_parameters() const {
  return shared_gradients_ ? shared_gradients_->groups() : std::vector<SharedParameterGroup>{};
}

std::string Pipeline::shared_parameters_report() const {
  return shared_gradients_ ? shared_gradients_->report() : std::string();
}

PipelineStage& Pipeline::local_stage(int stage) {
  TORCH_INTERNAL_ASSERT(stage_rank(stage) == rank_);
  return *stages_.at(stage / spec_.ranks);
}

std::vector<int> Pipeline::stages() const {
  std::vector<int> indices;
  for (const auto& stage : stages_) {
    indices.push_back(stage->index());
  }
  return indices;
}

bool Pipeline::has_last_stage() const { return stages_.back()->is_last(); }

void Pipeline::check_usable(const char* call) const {
  TORCH_CHECK(!failed_, "pipeline.", call, ": an earlier step or forward failed on this rank (rank ", rank_,
              "); its peers may be anywhere in that step, so this pipeline cannot go on: build a new one");
}

// One step's micro-batches, the results that wait for the action consuming them, and the loss so far.
class Pipeline::StepRun {
 public:
  // Splits the batch; throws before anything is sent when it does not split into equal micro-batches.
  StepRun(Pipeline& pipeline, const Tensors& inputs, const at::Tensor& target)
      : pipeline_(pipeline), microbatches_(pipeline.spec_.microbatches), last_(pipeline.spec_.stages() - 1),
        targets_(microbatches_) {
    if (pipeline_.stage_rank(0) == pipeline_.rank_) {
      TORCH_CHECK(!inputs.empty(), "pipeline.step: the first stage's rank needs inputs");
      check_equal_microbatches(inputs, microbatches_, "step", "input");
      inputs_ = split_microbatches(inputs, microbatches_);
    }
    if (pipeline_.has_last_stage() && target.defined()) {
      check_equal_microbatches({target}, microbatches_, "step", "target");
      auto parts = split_microbatches({target}, microbatches_);
      for (int mb = 0; mb < microbatches_; ++mb) {
        targets_[mb] = parts[mb].front();
      }
    }
  }

  void execute(const Action& action) {
    const int s = action.stage, mb = action.microbatch;
    const StageMicrobatch key{s, mb};
    auto& links = *pipeline_.links_;
    switch (action.type) {
      case ActionType::RecvActivation: {
        // A schedule may post micro-batch mb's receive before running mb - 1 (GPipe's last stage): the
        // wait for mb - 1's header then happens here, and is waiting, not host work.
        waited([&] {
          links.wait_for_previous_header(s, mb);
          return 0;
        });
        links.post_activations(s, mb, pipeline_.stage_rank(s - 1));
        break;
      }
      case ActionType::Forward:
        forward(action);
        break;
      case ActionType::SendActivation: {
        auto out = take(outputs_, key, "activation to send");
        sent_[key] = metas_of(out);
        links.send_activations(out, s + 1, mb, pipeline_.stage_rank(s + 1));
        break;
      }
      case ActionType::RecvGradient:
        arriving_gradients_.emplace(
            key, links.post_gradients(take(sent_, key, "sent activation"), s, mb, pipeline_.stage_rank(s + 1)));
        break;
      case ActionType::Backward:
      case ActionType::BackwardInput:
        backward(action);
        break;
      case ActionType::BackwardWeight: {
        const double started = milliseconds();
        pipeline_.local_stage(s).backward_weight(mb);
        pipeline_.timeline_.push_back({action, started, milliseconds()});
        weights_done(s);
        break;
      }
      case ActionType::SendGradient:
        links.send_gradients(take(input_gradients_, key, "input gradient to send"),
                             take(received_, key, "received activation"), s - 1, mb, pipeline_.stage_rank(s - 1));
        break;
    }
  }

  double milliseconds() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
  }
  // What `blocking()` returns; the time it took counts as waiting.
  template <typename Blocking>
  auto waited(Blocking blocking) -> decltype(blocking()) {
    const double started = milliseconds();
    auto result = blocking();
    waiting_ms_ += milliseconds() - started;
    return result;
  }
  double waiting_milliseconds() const { return waiting_ms_; }
  // The sum of the micro-batches' scaled losses: the batch's mean loss (last stage's rank only).
  const at::Tensor& loss() const { return loss_sum_; }

 private:
  void forward(const Action& action) {
    const int s = action.stage, mb = action.microbatch;
    Tensors in;
    if (s == 0) {
      in = inputs_[mb];
    } else if (pipeline_.stage_rank(s - 1) != pipeline_.rank_) {
      in = waited([&] { return pipeline_.links_->receive_activations(s, mb); });
      received_[{s, mb}] = metas_of(in);
    } else {
      in = take(outputs_, {s - 1, mb}, "local activation");
    }
    const double started = milliseconds();
    auto out = pipeline_.local_stage(s).forward(mb, stage_inputs(in, s == 0), s == last_ ? targets_[mb] : at::Tensor(),
                                                1.0 / microbatches_);
    pipeline_.timeline_.push_back({action, started, milliseconds()});
    if (s == last_) {
      loss_sum_ = loss_sum_.defined() ? loss_sum_ + out[0] : out[0];
    } else {
      outputs_[{s, mb}] = std::move(out);
    }
  }

  // Backward (B) or its input-gradient half (I).
  void backward(const Action& action) {
    const int s = action.stage, mb = action.microbatch;
    Tensors gradients;
    if (s != last_) {
      if (pipeline_.stage_rank(s + 1) != pipeline_.rank_) {
        auto pending = take(arriving_gradients_, {s, mb}, "posted gradient receive");
        gradients = waited([&] { return pipeline_.links_->wait(pending); });
      } else {
        gradients = take(input_gradients_, {s + 1, mb}, "local gradient");
      }
    }
    auto& stage = pipeline_.local_stage(s);
    const double started = milliseconds();
    auto result = action.type == ActionType::Backward ? stage.backward(mb, gradients)
                                                      : stage.backward_input(mb, gradients);
    pipeline_.timeline_.push_back({action, started, milliseconds()});
    if (s > 0) {
      input_gradients_[{s, mb}] = std::move(result);
    }
    if (action.type == ActionType::Backward) {
      weights_done(s);
    }
  }

  // A stage's gradients are complete after its last micro-batch's weight pass: their average over
  // the replicas can start while later actions run.
  void weights_done(int stage) {
    if (++weight_passes_[stage] == microbatches_ && pipeline_.replica_gradients_) {
      pipeline_.replica_gradients_->launch(stage / pipeline_.spec_.ranks);
    }
  }

  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  double waiting_ms_ = 0;
  Pipeline& pipeline_;
  const int microbatches_;
  const int last_;
  std::vector<Tensors> inputs_;  // per micro-batch, on the first stage's rank
  Tensors targets_;              // per micro-batch; undefined off the last stage's rank
  std::map<StageMicrobatch, PendingGradients> arriving_gradients_;
  std::map<StageMicrobatch, Tensors> outputs_;          // forward results not yet consumed
  std::map<StageMicrobatch, Tensors> input_gradients_;  // backward results not yet consumed
  std::map<StageMicrobatch, TensorMetas> sent_, received_;
  std::map<int, int> weight_passes_;
  at::Tensor loss_sum_;
};

at::Tensor Pipeline::step(const Tensors& inputs, const at::Tensor& target) {
  check_usable("step");
  timeline_.clear();
  StepRun run(*this, inputs, target);
  try {
    for (const auto& action : actions_) {
      run.execute(action);
    }
    run.waited([this] {
      links_->wait_sends();
      return 0;
    });
    // After every W: the copies of a tied parameter get their summed gradient, then (being final)
    // its average over the replicas, with the other stages' averages already under way.
    if (shared_gradients_) {
      shared_gradients_->reduce();
    }
    if (replica_gradients_) {
      if (late_replica_gradients_) {
        replica_gradients_->launch(stages_.size());
      }
      replica_gradients_->finish();
    }
    step_milliseconds_ = run.milliseconds();
    waiting_milliseconds_ = run.waiting_milliseconds();
  } catch (...) {
    abandon();
  }
  return options_.loss_on_all_ranks() ? broadcast_loss(run.loss()) : run.loss();
}

at::Tensor Pipeline::broadcast_loss(const at::Tensor& loss_sum) {
  const auto device = message_device(*options_.process_group());
  std::vector<at::Tensor> loss{has_last_stage() ? loss_sum.detach().reshape({1}).to(device, at::kDouble)
                                                : at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device))};
  try {
    options_.process_group()->broadcast(loss, {stage_rank(spec_.stages() - 1), 0})->wait();
  } catch (...) {
    abandon();
  }
  return has_last_stage() ? loss_sum : loss[0].reshape({}).to(at::kCPU, at::kFloat);
}

void Pipeline::abandon() {
  for (auto& stage : stages_) {
    stage->discard_in_flight();
  }
  links_->discard_pending();
  if (replica_gradients_) {
    replica_gradients_->discard();
  }
  // The peers' view of this call is unknown (which transfers and all-reduces completed), so no
  // later step could be trusted to pair its messages with theirs.
  failed_ = true;
  peers_.rethrow_naming_lost();
}

Tensors Pipeline::forward(const Tensors& inputs) {
  check_usable("forward");
  try {
    return run_forward(inputs);
  } catch (...) {
    abandon();
  }
}

Tensors Pipeline::run_forward(const Tensors& inputs) {
  const int m = spec_.microbatches;
  const int last = spec_.stages() - 1;
  std::vector<Tensors> input_microbatches(m);
  if (stage_rank(0) == rank_) {
    TORCH_CHECK(!inputs.empty(), "pipeline.forward: the first stage's rank needs inputs");
    input_microbatches = split_microbatches(inputs, m);
  }
  std::map<StageMicrobatch, Tensors> local_outputs;
  std::vector<Tensors> results;
  // Every rank visits its (micro-batch, stage) pairs in lexicographic order; each waits only for a
  // smaller pair, so the smallest unfinished one can always run.
  for (int mb = 0; mb < m; ++mb) {
    for (auto& stage : stages_) {
      const int s = stage->index();
      Tensors in;
      if (s == 0) {
        in = input_microbatches[mb];
      } else if (stage_rank(s - 1) != rank_) {
        links_->post_activations(s, mb, stage_rank(s - 1));
        in = links_->receive_activations(s, mb);
      } else {
        in = take(local_outputs, {s - 1, mb}, "local activation");
      }
      auto out = stage->infer(in);
      if (s == last) {
        results.push_back(std::move(out));
      } else if (stage_rank(s + 1) != rank_) {
        links_->send_activations(out, s + 1, mb, stage_rank(s + 1));
      } else {
        local_outputs[{s, mb}] = std::move(out);
      }
    }
  }
  links_->wait_sends();
  if (results.empty()) {
    return {};
  }
  Tensors joined;
  for (size_t i = 0; i < results.front().size(); ++i) {
    Tensors parts;
    for (const auto& result : results) {
      parts.push_back(result[i]);
    }
    joined.push_back(at::cat(parts));
  }
  return joined;
}

} // namespace torchpar::pipeline
