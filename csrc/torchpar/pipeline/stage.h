// One pipeline stage on its rank: runs its layers on micro-batches and keeps, per micro-batch, what
// the backward passes need. Every stage input is a fresh leaf, so each stage's autograd graph ends at
// its boundary and gradients cross stages only as tensors the runtime sends.
#pragma once
#include <torchpar/pipeline/layer.h>

#include <ATen/core/Generator.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace torchpar::pipeline {

// The last stage's loss for one micro-batch, from its outputs and targets.
using LossFn = std::function<at::Tensor(const Tensors& outputs, const at::Tensor& target)>;

class PipelineStage {
 public:
  // `first_layer` numbers the layers in messages; `loss` is set on the last stage only.
  // `split_backward`: backward runs as backward_input + backward_weight (zero-bubble schedules).
  PipelineStage(int index, int first_layer, std::vector<Layer> layers, bool checkpoint_activations,
                bool split_backward, LossFn loss = nullptr);

  // Runs the layers on `inputs` (requires_grad set on floating-point inputs of every stage but the
  // first). On the last stage returns the micro-batch's loss (already scaled by `loss_scale`); on
  // the others, the outputs detached from the graph, ready to send.
  Tensors forward(int microbatch, Tensors inputs, const at::Tensor& target = {}, double loss_scale = 1.0);
  // Forward only, nothing kept (evaluation).
  Tensors infer(const Tensors& inputs);

  // Input gradients and weight gradients in one pass; returns the input gradients (undefined for
  // inputs that take none). `output_gradients` is empty on the last stage.
  Tensors backward(int microbatch, const Tensors& output_gradients);
  // Zero-bubble split: input gradients now (layer by layer, keeping each layer's output gradient) ...
  Tensors backward_input(int microbatch, const Tensors& output_gradients);
  // ... weight gradients later, from the kept output gradients; frees the micro-batch.
  void backward_weight(int microbatch);

  int index() const { return index_; }
  // The model index of layers()[0].
  int first_layer() const { return first_layer_; }
  const std::vector<Layer>& layers() const { return layers_; }
  bool is_last() const { return static_cast<bool>(loss_); }
  Tensors parameters() const;
  // "stage 1 (layers 3-5)"
  std::string describe() const;
  // After a failed step: forget the micro-batches whose backward will never run.
  void discard_in_flight() { in_flight_.clear(); }

 private:
  struct InFlight {
    Tensors inputs;                       // the stage's input leaves
    at::Tensor target;                    // last stage only, for a recomputed loss
    double loss_scale = 1.0;
    at::Tensor rng_state;                 // CPU generator before the forward, for recomputation
    Tensors outputs;                      // with the graph (not kept when checkpointing)
    at::Tensor loss;                      // last stage
    // Split backward only: each layer's inputs (leaves) and outputs, so every layer has a graph of
    // its own and its weight gradients can be computed apart from the others.
    std::vector<Tensors> layer_inputs;
    std::vector<Tensors> layer_outputs;
    Tensors loss_inputs;                    // leaves standing for the last layer's outputs
    std::vector<Tensors> output_gradients;  // per layer, filled by backward_input for backward_weight
  };

  // Fills state.outputs (and the per-layer lists when splitting) and, on the last stage, state.loss.
  void run(int microbatch, InFlight& state);
  Tensors call_layer(size_t layer, const Tensors& inputs, int microbatch);
  InFlight& state_of(int microbatch, const char* pass);
  std::string where(int microbatch) const;

  int index_;
  int first_layer_;
  std::vector<Layer> layers_;
  std::vector<bool> modifies_inputs_;  // per layer: found to change its inputs in place
  bool checkpoint_;
  bool split_backward_;
  LossFn loss_;
  std::map<int, InFlight> in_flight_;
};

} // namespace torchpar::pipeline
