// Options of torchpar's pipeline, in LibTorch's builder style:
//   PipelineOptions().process_group(group).schedule("1f1b").microbatches(8)
#pragma once
#include <torch/arg.h>
#include <torchpar/common/c10d_fwd.h>
#include <torchpar/pipeline/shared_parameters.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <string>
#include <vector>

namespace torchpar::pipeline {

struct PipelineOptions {
  // The ranks of one pipeline, stage k on group rank k % size (required).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, process_group);
  // Pipeline x data parallel: the ranks holding the same stages in other replicas; their gradients
  // are averaged at the end of each step. Null: one replica.
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, data_parallel_group);
  // One of schedule_names() (schedules.h).
  TORCH_ARG(std::string, schedule) = "1f1b";
  TORCH_ARG(int, microbatches) = 1;
  // Stages per rank (interleaved only).
  TORCH_ARG(int, virtual_stages) = 1;
  // Layers per stage; empty: chosen by `balance_by`.
  TORCH_ARG(std::vector<int64_t>, balance);
  // "uniform" (layer count), "parameters" (parameter count) or "time" (forward+backward of each
  // layer measured on `sample_input`, one micro-batch).
  TORCH_ARG(std::string, balance_by) = "uniform";
  TORCH_ARG(std::vector<at::Tensor>, sample_input);
  // Keep only each stage's inputs in forward and recompute the rest in backward.
  TORCH_ARG(bool, checkpoint_activations) = false;
  // step() returns the loss on every rank (one broadcast per step) or only on the last stage's rank.
  TORCH_ARG(bool, loss_on_all_ranks) = true;
  // Gradient bytes per all-reduce across replicas.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  // Tied parameters: each group names parameters that are one ({{{0, "weight"}, {11, "weight"}}}: the
  // input embedding and the LM head). Their copies start equal and each step sums their gradients over
  // the ranks holding them (shared_gradients.h). Built layers tying one tensor need no declaration:
  // the pipeline finds it.
  TORCH_ARG(std::vector<SharedParameterGroup>, shared_parameters);
};

} // namespace torchpar::pipeline
