#include <torchpar/pipeline/pipeline.h>

#include <torchpar/pipeline/layer_profile.h>
#include <torchpar/pipeline/p2p.h>
#include <torchpar/pipeline/partition.h>
#include <torchpar/pipeline/replica_gradients.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <map>
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

Tensors split_microbatches(const at::Tensor& tensor, int microbatches, const char* what, size_t index) {
  TORCH_CHECK(tensor.defined() && tensor.dim() > 0, "pipeline.step: ", what, " ", index,
              " must be a tensor with a batch dimension");
  const int64_t batch = tensor.size(0);
  TORCH_CHECK(batch % microbatches == 0, "pipeline.step: a batch of ", batch, " samples (", what, " ", index, " ",
              describe(metas_of({tensor})), ") does not split into ", microbatches,
              " equal micro-batches; use a batch size divisible by ", microbatches);
  return tensor.split(batch / microbatches);
}

Tensors stage_inputs(const Tensors& received, bool first_stage) {
  Tensors leaves;
  for (const auto& tensor : received) {
    const bool differentiable = !first_stage && carries_gradient({tensor.scalar_type(), {}});
    leaves.push_back(differentiable ? tensor.detach().requires_grad_(true) : tensor);
  }
  return leaves;
}

} // namespace

Pipeline::Pipeline(std::vector<LayerFactory> factories, LossFn loss, PipelineOptions options)
    : options_(std::move(options)) {
  build(std::move(factories), std::move(loss));
}

Pipeline::Pipeline(const std::vector<Layer>& layers, LossFn loss, PipelineOptions options)
    : options_(std::move(options)) {
  std::vector<LayerFactory> factories;
  for (const auto& layer : layers) {
    factories.push_back([layer] { return layer; });
  }
  build(std::move(factories), std::move(loss));
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

void Pipeline::build(std::vector<LayerFactory> factories, LossFn loss) {
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
  plan_partition(factories);
  actions_ = rank_actions(spec_, rank_);

  const auto boundaries = stage_boundaries(balance_);
  const bool split = spec_.kind == ScheduleKind::ZeroBubbleH1;
  std::vector<std::vector<at::Tensor>> stage_parameters;
  for (int stage = rank_; stage < spec_.stages(); stage += spec_.ranks) {
    std::vector<Layer> layers;
    for (int64_t layer = boundaries[stage]; layer < boundaries[stage + 1]; ++layer) {
      layers.push_back(factories[layer]());
    }
    const bool last = stage == spec_.stages() - 1;
    stages_.push_back(std::make_unique<PipelineStage>(stage, static_cast<int>(boundaries[stage]), std::move(layers),
                                                      options_.checkpoint_activations(), split,
                                                      last ? loss : LossFn()));
    stage_parameters.push_back(stages_.back()->parameters());
  }
  // Every rank must agree on where messages live: on the GPU exactly when the group's default
  // backend is NCCL (a rank whose stages hold no parameters cannot tell from its own).
  const c10::Device device = nccl ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
  links_ = std::make_unique<StageLinks>(options_.process_group(), device);
  peers_ = PeerProcesses::gather(group, device);
  if (options_.data_parallel_group() && options_.data_parallel_group()->getSize() > 1) {
    replica_gradients_ = std::make_unique<ReplicaGradients>(options_.data_parallel_group(),
                                                            std::move(stage_parameters), options_.bucket_cap_mb());
  }
}

PipelineStage& Pipeline::local_stage(int stage) {
  TORCH_INTERNAL_ASSERT(stage_rank(stage) == rank_);
  return *stages_.at(stage / spec_.ranks);
}

Tensors Pipeline::parameters() const {
  Tensors parameters;
  for (const auto& stage : stages_) {
    auto own = stage->parameters();
    parameters.insert(parameters.end(), own.begin(), own.end());
  }
  return parameters;
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

at::Tensor Pipeline::step(const Tensors& inputs, const at::Tensor& target) {
  check_usable("step");
  const auto step_start = std::chrono::steady_clock::now();
  auto since_step_start = [&] {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - step_start).count();
  };
  timeline_.clear();
  const int m = spec_.microbatches;
  const int last = spec_.stages() - 1;
  std::vector<Tensors> input_microbatches(m);
  if (stage_rank(0) == rank_) {
    TORCH_CHECK(!inputs.empty(), "pipeline.step: the first stage's rank needs inputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      auto chunks = split_microbatches(inputs[i], m, "input", i);
      for (int mb = 0; mb < m; ++mb) {
        input_microbatches[mb].push_back(chunks[mb]);
      }
    }
  }
  Tensors target_microbatches(m);
  if (has_last_stage() && target.defined()) {
    target_microbatches = split_microbatches(target, m, "target", 0);
  }

  std::map<StageMicrobatch, PendingGradients> arriving_gradients;
  std::map<StageMicrobatch, Tensors> outputs;           // forward results not yet consumed
  std::map<StageMicrobatch, Tensors> input_gradients;   // backward results not yet consumed
  std::map<StageMicrobatch, TensorMetas> sent, received;
  std::map<int, int> weight_passes;
  at::Tensor loss_sum;

  auto weights_done = [&](int stage) {
    if (++weight_passes[stage] == m && replica_gradients_) {
      replica_gradients_->launch(stage / spec_.ranks);
    }
  };

  try {
    for (const auto& action : actions_) {
      const int s = action.stage, mb = action.microbatch;
      const StageMicrobatch key{s, mb};
      switch (action.type) {
        case ActionType::RecvActivation:
          links_->post_activations(s, mb, stage_rank(s - 1));
          break;
        case ActionType::Forward: {
          Tensors in;
          if (s == 0) {
            in = input_microbatches[mb];
          } else if (stage_rank(s - 1) != rank_) {
            in = links_->receive_activations(s, mb);
            received[key] = metas_of(in);
          } else {
            in = take(outputs, {s - 1, mb}, "local activation");
          }
          const double started = since_step_start();
          auto out = local_stage(s).forward(mb, stage_inputs(in, s == 0), s == last ? target_microbatches[mb] : at::Tensor(),
                                            1.0 / m);
          timeline_.push_back({action, started, since_step_start()});
          if (s == last) {
            loss_sum = loss_sum.defined() ? loss_sum + out[0] : out[0];
          } else {
            outputs[key] = std::move(out);
          }
          break;
        }
        case ActionType::SendActivation: {
          auto out = take(outputs, key, "activation to send");
          sent[key] = metas_of(out);
          links_->send_activations(out, s + 1, mb, stage_rank(s + 1));
          break;
        }
        case ActionType::RecvGradient:
          arriving_gradients.emplace(key, links_->post_gradients(take(sent, key, "sent activation"), s, mb,
                                                                 stage_rank(s + 1)));
          break;
        case ActionType::Backward:
        case ActionType::BackwardInput: {
          Tensors gradients;
          if (s != last) {
            if (stage_rank(s + 1) != rank_) {
              auto pending = take(arriving_gradients, key, "posted gradient receive");
              gradients = links_->wait(pending);
            } else {
              gradients = take(input_gradients, {s + 1, mb}, "local gradient");
            }
          }
          auto& stage = local_stage(s);
          const double started = since_step_start();
          auto result = action.type == ActionType::Backward ? stage.backward(mb, gradients)
                                                            : stage.backward_input(mb, gradients);
          timeline_.push_back({action, started, since_step_start()});
          if (s > 0) {
            input_gradients[key] = std::move(result);
          }
          if (action.type == ActionType::Backward) {
            weights_done(s);
          }
          break;
        }
        case ActionType::BackwardWeight: {
          const double started = since_step_start();
          local_stage(s).backward_weight(mb);
          timeline_.push_back({action, started, since_step_start()});
          weights_done(s);
          break;
        }
        case ActionType::SendGradient:
          links_->send_gradients(take(input_gradients, key, "input gradient to send"),
                                 take(received, key, "received activation"), s - 1, mb, stage_rank(s - 1));
          break;
      }
    }
    links_->wait_sends();
    if (replica_gradients_) {
      replica_gradients_->finish();
    }
    step_milliseconds_ = since_step_start();
  } catch (...) {
    for (auto& stage : stages_) {
      stage->discard_in_flight();
    }
    links_->discard_pending();
    if (replica_gradients_) {
      replica_gradients_->discard();
    }
    // The peers' view of this step is unknown (which transfers and all-reduces completed), so no
    // later step could be trusted to pair its messages with theirs.
    failed_ = true;
    peers_.rethrow_naming_lost();
  }

  if (!options_.loss_on_all_ranks()) {
    return loss_sum;
  }
  const auto device = options_.process_group()->getBackendType() == c10d::ProcessGroup::BackendType::NCCL
                          ? c10::Device(c10::kCUDA)
                          : c10::Device(c10::kCPU);
  std::vector<at::Tensor> loss{has_last_stage() ? loss_sum.detach().reshape({1}).to(device, at::kDouble)
                                                : at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device))};
  try {
    options_.process_group()->broadcast(loss, {stage_rank(last), 0})->wait();
  } catch (...) {
    failed_ = true;
    peers_.rethrow_naming_lost();
  }
  return has_last_stage() ? loss_sum : loss[0].reshape({}).to(at::kCPU, at::kFloat);
}

Tensors Pipeline::forward(const Tensors& inputs) {
  check_usable("forward");
  try {
    return run_forward(inputs);
  } catch (...) {
    for (auto& stage : stages_) {
      stage->discard_in_flight();
    }
    links_->discard_pending();
    failed_ = true;
    peers_.rethrow_naming_lost();
  }
}

Tensors Pipeline::run_forward(const Tensors& inputs) {
  const int m = spec_.microbatches;
  const int last = spec_.stages() - 1;
  std::vector<Tensors> input_microbatches(m);
  if (stage_rank(0) == rank_) {
    TORCH_CHECK(!inputs.empty(), "pipeline.forward: the first stage's rank needs inputs");
    for (const auto& input : inputs) {
      auto chunks = input.tensor_split(m);
      for (int mb = 0; mb < m; ++mb) {
        input_microbatches[mb].push_back(chunks[mb]);
      }
    }
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
