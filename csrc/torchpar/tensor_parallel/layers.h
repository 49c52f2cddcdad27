// Megatron-style tensor-parallel layers for LibTorch: one layer's weight split over the ranks of a
// tensor-parallel group, each rank computing with its shard and the mappings (mappings.h) stitching
// the results. Every rank builds the full single-process layer from the global generator and keeps its
// slice, so with the same seed on every rank the shards together are exactly what torch::nn::Linear /
// torch::nn::Embedding would hold. The constructor checks, with one small all-gather, that every rank
// of the group builds the same layer: the same sizes, and the same initial values (a hash of the full
// layer each rank drew), so ranks seeded differently are refused instead of training different models.
//
//   ColumnParallelLinear(group, ColumnParallelLinearOptions(1024, 4096))     output features split
//   RowParallelLinear(group, RowParallelLinearOptions(4096, 1024))           input features split
//   VocabParallelEmbedding(group, VocabParallelEmbeddingOptions(50000, 1024)) rows split by id range
//
// A column layer followed by a row layer (an MLP, or attention's QKV and output projections) needs
// one all-reduce in forward and one in backward.
#pragma once
#include <torchpar/tensor_parallel/mappings.h>
#include <torchpar/tensor_parallel/vocabulary.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <string>

namespace torchpar::tensor_parallel {

struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features); // the full layer's; each rank holds out_features / group size
  TORCH_ARG(bool, bias) = true;
  // All-gather the output so every rank has all out_features (else each keeps its slice, as the
  // input of a RowParallelLinear with input_is_parallel).
  TORCH_ARG(bool, gather_output) = false;
  // The input is split along dim 0 (sequence parallelism): all-gathered here, reduce-scattered back.
  TORCH_ARG(bool, sequence_parallel) = false;
  // How errors name the layer ("blocks.3.mlp.up").
  TORCH_ARG(std::string, name) = "ColumnParallelLinear";
};

class ColumnParallelLinearImpl : public torch::nn::Cloneable<ColumnParallelLinearImpl> {
 public:
  ColumnParallelLinearImpl(Group group, ColumnParallelLinearOptions options);
  void reset() override;
  at::Tensor forward(const at::Tensor& input);

  ColumnParallelLinearOptions options;
  Group group;
  at::Tensor weight; // [out_features / size, in_features]
  at::Tensor bias;   // [out_features / size], or undefined
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelLinearOptions {
  RowParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features); // the full layer's; each rank holds in_features / group size
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true; // added once, after the reduction (the same on every rank)
  // The input is already split along its last dim (a ColumnParallelLinear's output); else it is sliced here.
  TORCH_ARG(bool, input_is_parallel) = true;
  // Reduce-scatter the output along dim 0 instead of all-reducing it (sequence parallelism).
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(std::string, name) = "RowParallelLinear";
};

class RowParallelLinearImpl : public torch::nn::Cloneable<RowParallelLinearImpl> {
 public:
  RowParallelLinearImpl(Group group, RowParallelLinearOptions options);
  void reset() override;
  at::Tensor forward(const at::Tensor& input);

  RowParallelLinearOptions options;
  Group group;
  at::Tensor weight; // [out_features, in_features / size]
  at::Tensor bias;   // [out_features], replicated, or undefined
};
TORCH_MODULE(RowParallelLinear);

struct VocabParallelEmbeddingOptions {
  VocabParallelEmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings); // the vocabulary; rank r holds ids [r * V / size, (r + 1) * V / size)
  TORCH_ARG(int64_t, embedding_dim);
  // Reduce-scatter the output along dim 0 instead of all-reducing it (sequence parallelism).
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(std::string, name) = "VocabParallelEmbedding";
};

class VocabParallelEmbeddingImpl : public torch::nn::Cloneable<VocabParallelEmbeddingImpl> {
 public:
  VocabParallelEmbeddingImpl(Group group, VocabParallelEmbeddingOptions options);
  void reset() override;
  // ids: int64 of any shape, each in [0, num_embeddings); returns [*ids.shape, embedding_dim].
  at::Tensor forward(const at::Tensor& ids);

  VocabParallelEmbeddingOptions options;
  Group group;
  at::Tensor weight; // [num_embeddings / size, embedding_dim]
};
TORCH_MODULE(VocabParallelEmbedding);

// Where tensor-parallel shards come from: the full layer as torch::nn builds it from the global
// generator, sliced, after the check above (collective over the group). Shared with the Python modules,
// which hold the shards as nn.Parameters.
struct LinearShards {
  at::Tensor weight;
  at::Tensor bias; // undefined without bias
};
LinearShards column_parallel_shards(const Group& group, int64_t in_features, int64_t out_features, bool bias,
                                    const std::string& name);
LinearShards row_parallel_shards(const Group& group, int64_t in_features, int64_t out_features, bool bias,
                                 const std::string& name);
at::Tensor vocab_parallel_shard(const Group& group, int64_t num_embeddings, int64_t embedding_dim,
                                const std::string& name);

// The layers' forward passes as functions of their shards: what the modules above and the Python
// modules (torchpar.tensor_parallel) both run.
at::Tensor column_parallel_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                                  const Group& group, bool gather_output, bool sequence_parallel,
                                  const std::string& name);
at::Tensor row_parallel_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                               const Group& group, bool input_is_parallel, bool sequence_parallel,
                               const std::string& name);
// Checks every id is in [0, num_embeddings), naming the layer.
at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight, const Group& group,
                                    int64_t num_embeddings, bool sequence_parallel, const std::string& name);

} // namespace torchpar::tensor_parallel
