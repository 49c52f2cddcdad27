// Pipeline parallelism for LibTorch: a model cut into stages on different ranks, trained on
// micro-batches driven by a schedule (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1).
//
//   std::vector<torchpar::pipeline::LayerFactory> layers = ...;   // each rank builds only its own
//   torchpar::pipeline::Pipeline pipe(layers, loss_fn,
//       torchpar::pipeline::PipelineOptions().process_group(group).schedule("1f1b").microbatches(8));
//   torch::optim::SGD optimizer(pipe.parameters(), 0.1);
//   optimizer.zero_grad();
//   auto loss = pipe.step(inputs, targets);   // forward + backward of the whole batch
//   optimizer.step();
#pragma once
#include <torchpar/common/peer_processes.h>
#include <torchpar/pipeline/layer.h>
#include <torchpar/pipeline/options.h>
#include <torchpar/pipeline/schedules.h>
#include <torchpar/pipeline/simulator.h>
#include <torchpar/pipeline/stage.h>

#include <memory>
#include <string>
#include <vector>

namespace torchpar::pipeline {

class StageLinks;
class ReplicaGradients;
class SharedGradients;

class Pipeline {
 public:
  // Builds the layers of this rank's stages only (`factories` has one entry per layer of the model);
  // tied parameters are those options.shared_parameters declares.
  Pipeline(std::vector<LayerFactory> factories, LossFn loss, PipelineOptions options);
  // All layers already built (small models, tests); this rank keeps only its own. A tensor that two
  // layers list is tied too, without a declaration.
  Pipeline(const std::vector<Layer>& layers, LossFn loss, PipelineOptions options);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // One training step on a batch: split into equal micro-batches along dimension 0 (a batch size
  // that does not divide is refused before anything is sent), run the schedule,
  // accumulate every stage's gradients (averaged over the batch, as a mean loss over it would give),
  // sum a tied parameter's over the ranks holding a copy, average them over the data-parallel replicas. Returns the batch's mean loss (on every rank, or
  // only on the last stage's rank — undefined elsewhere — see loss_on_all_ranks). `inputs` matter
  // on the first stage's rank, `target` on the last's; other ranks may pass undefined tensors.
  at::Tensor step(const Tensors& inputs, const at::Tensor& target);
  at::Tensor step(const at::Tensor& input, const at::Tensor& target) { return step(Tensors{input}, target); }

  // Forward only, without gradients (evaluation), of a batch of any size (cut as split_microbatches
  // cuts); the last stage's outputs on its rank, empty elsewhere.
  Tensors forward(const Tensors& inputs);

  // This rank's parameters (what its optimizer steps on), a tied parameter once.
  Tensors parameters() const { return parameters_; }
  // The tied parameters, declared and found, merged (merge_shared_parameters); empty: none.
  std::vector<SharedParameterGroup> shared_parameters() const;
  // One line per tied group: its stages and ranks, where its values came from.
  std::string shared_parameters_report() const;
  // The global indices of this rank's stages.
  std::vector<int> stages() const;
  bool has_last_stage() const;
  const std::vector<int64_t>& balance() const { return balance_; }
  // The partition and its predicted stage costs, one line per stage.
  const std::string& partition_report() const { return partition_report_; }
  const ScheduleSpec& schedule() const { return spec_; }
  // This rank's action list (what step() executes).
  const std::vector<Action>& actions() const { return actions_; }
  // The last step as it ran on this rank: each compute action's start and end in milliseconds
  // since the step began (waiting for data excluded), and the step's duration up to its last send
  // (the loss broadcast excluded) — the measured counterpart of the simulator's timeline.
  const std::vector<TimedAction>& last_step_timeline() const { return timeline_; }
  double last_step_milliseconds() const { return step_milliseconds_; }
  // The part of the last step this rank spent blocked on transfers: waiting for an activation or a
  // gradient to arrive, and for its sends to complete at the end. What the step holds beyond this and
  // the timeline's compute is host work: posting transfers, the schedule's own bookkeeping.
  double last_step_waiting_milliseconds() const { return waiting_milliseconds_; }

 private:
  class StepRun;  // one step's state and its action switch

  void build(std::vector<LayerFactory> factories, LossFn loss, std::vector<SharedParameterGroup> shared);
  // This rank's parameters once each, and the data-parallel averaging's lists: per local stage, then
  // those whose gradients are final only at the end of the step (tied, or in several local stages).
  std::vector<std::vector<at::Tensor>> collect_parameters();
  void plan_partition(const std::vector<LayerFactory>& factories);
  PipelineStage& local_stage(int stage);
  void check_usable(const char* call) const;
  Tensors run_forward(const Tensors& inputs);
  // Returns the step's loss on every rank (`loss_sum` on the last stage's, undefined elsewhere).
  at::Tensor broadcast_loss(const at::Tensor& loss_sum);
  // Inside a catch block, after a failed step or forward: drops what is in flight, marks this
  // pipeline unusable and rethrows.
  [[noreturn]] void abandon();
  int stage_rank(int stage) const { return rank_of_stage(stage, spec_.ranks); }

  PipelineOptions options_;
  ScheduleSpec spec_;
  int rank_ = 0;
  std::vector<int64_t> balance_;
  std::string partition_report_;
  std::vector<Action> actions_;
  std::vector<TimedAction> timeline_;
  double step_milliseconds_ = 0;
  double waiting_milliseconds_ = 0;
  bool failed_ = false;
  std::vector<std::unique_ptr<PipelineStage>> stages_;  // this rank's, in increasing stage order
  std::unique_ptr<StageLinks> links_;
  std::unique_ptr<SharedGradients> shared_gradients_;
  std::unique_ptr<ReplicaGradients> replica_gradients_;
  bool late_replica_gradients_ = false;  // the replicas' last list: the parameters shared by stages
  Tensors parameters_;
  PeerProcesses peers_;  // to name the rank that died or stopped in a failed step's error
};

} // namespace torchpar::pipeline
