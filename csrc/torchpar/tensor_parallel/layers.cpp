#include <torchpar/tensor_parallel/layers.h>

#include <ATen/ops/embedding.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/tensor.h>
#include <c10/core/GradMode.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <sstream>

namespace torchpar::tensor_parallel {
namespace {

void check_divides(int64_t features, int size, const std::string& name, const char* what) {
  TORCH_CHECK(size > 0 && features % size == 0, name, ": ", what, " ", features,
              " does not divide by the tensor-parallel size ", size, "; choose ", what,
              " that is a multiple of ", size, " (or another tensor-parallel size)");
}

// One small all-gather: every rank must build the same layer, else shards would not fit together
// (and a later collective would hang or mix unrelated data).
void check_same_layer(const Group& group, const std::string& name, const std::vector<int64_t>& config,
                      const char* fields) {
  const int size = group_size(group);
  if (size == 1) return;
  const auto mine = at::tensor(config, at::kLong);
  const auto all = collectives::all_gather(mine, 0, group).view({size, static_cast<int64_t>(config.size())});
  for (int rank = 0; rank < size; ++rank) {
    if (!all[rank].equal(mine)) {
      std::ostringstream ranks;
      for (int r = 0; r < size; ++r) {
        ranks << (r ? ", " : "") << "rank " << r << " [";
        for (size_t field = 0; field < config.size(); ++field) {
          ranks << (field ? ", " : "") << all[r][static_cast<int64_t>(field)].item<int64_t>();
        }
        ranks << "]";
      }
      TORCH_CHECK(false, name, ": the ranks of the tensor-parallel group built different layers (", fields,
                  "): ", ranks.str(), "; every rank of the group must build the same layer");
    }
  }
}

} // namespace

LinearShards column_parallel_shards(const Group& group, int64_t in_features, int64_t out_features, bool bias,
                                    const std::string& name) {
  const int size = group_size(group);
  check_divides(out_features, size, name, "out_features");
  check_same_layer(group, name, {in_features, out_features, bias}, "in_features, out_features, bias");
  c10::NoGradGuard no_grad;
  torch::nn::Linear full(torch::nn::LinearOptions(in_features, out_features).bias(bias));
  LinearShards shards;
  shards.weight = collectives::local_slice(full->weight, 0, group, name.c_str());
  if (bias) shards.bias = collectives::local_slice(full->bias, 0, group, name.c_str());
  return shards;
}

LinearShards row_parallel_shards(const Group& group, int64_t in_features, int64_t out_features, bool bias,
                                 const std::string& name) {
  const int size = group_size(group);
  check_divides(in_features, size, name, "in_features");
  check_same_layer(group, name, {in_features, out_features, bias}, "in_features, out_features, bias");
  c10::NoGradGuard no_grad;
  torch::nn::Linear full(torch::nn::LinearOptions(in_features, out_features).bias(bias));
  LinearShards shards;
  shards.weight = collectives::local_slice(full->weight, 1, group, name.c_str());
  if (bias) shards.bias = full->bias.detach().clone();
  return shards;
}

at::Tensor vocab_parallel_shard(const Group& group, int64_t num_embeddings, int64_t embedding_dim,
                                const std::string& name) {
  const int size = group_size(group);
  check_divides(num_embeddings, size, name, "num_embeddings");
  check_same_layer(group, name, {num_embeddings, embedding_dim}, "num_embeddings, embedding_dim");
  c10::NoGradGuard no_grad;
  torch::nn::Embedding full(num_embeddings, embedding_dim);
  return collectives::local_slice(full->weight, 0, group, name.c_str());
}

at::Tensor column_parallel_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                                  const Group& group, bool gather_output, bool sequence_parallel,
                                  const std::string& name) {
  TORCH_CHECK(input.dim() > 0 && input.size(-1) == weight.size(1), name, ": input of shape ", input.sizes(),
              " does not end in in_features ", weight.size(1));
  const auto parallel_input =
      sequence_parallel ? gather_from_sequence_parallel(input, group) : copy_to_tensor_parallel(input, group);
  auto output = at::linear(parallel_input, weight, bias);
  return gather_output ? gather_from_tensor_parallel(output, group) : output;
}

at::Tensor row_parallel_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                               const Group& group, bool input_is_parallel, bool sequence_parallel,
                               const std::string& name) {
  TORCH_CHECK(!sequence_parallel || input_is_parallel, name,
              ": sequence_parallel needs input_is_parallel (the input of a ColumnParallelLinear's output)");
  const int64_t local_in = weight.size(1);
  const int64_t expected = input_is_parallel ? local_in : local_in * group_size(group);
  TORCH_CHECK(input.dim() > 0 && input.size(-1) == expected, name, ": input of shape ", input.sizes(),
              " does not end in ", expected,
              input_is_parallel ? " (in_features / tensor-parallel size: this rank's slice)" : " (in_features)");
  const auto parallel_input = input_is_parallel ? input : scatter_to_tensor_parallel(input, group);
  const auto partial = at::linear(parallel_input, weight);
  if (!sequence_parallel) {
    const auto output = reduce_from_tensor_parallel(partial, group);
    return bias.defined() ? output + bias : output;
  }
  // Each rank adds the bias to its own positions only: its gradient is summed over the group in backward.
  const auto output = reduce_scatter_to_sequence_parallel(partial, group);
  return bias.defined() ? output + copy_to_tensor_parallel(bias, group) : output;
}

at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight, const Group& group,
                                    int64_t num_embeddings, bool sequence_parallel, const std::string& name) {
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, name,
              ": ids must be int64 or int32, got ", ids.scalar_type());
  check_in_vocabulary(ids, num_embeddings, name, "id");
  const auto [begin, end] = vocab_range(num_embeddings, group_rank(group), group_size(group));
  // Ids of other ranks' rows look up row 0 and are zeroed: after the reduction each position holds
  // exactly its owner's row.
  const auto outside = (ids < begin).logical_or(ids >= end);
  const auto partial = at::embedding(weight, (ids - begin).masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0);
  return sequence_parallel ? reduce_scatter_to_sequence_parallel(partial, group)
                           : reduce_from_tensor_parallel(partial, group);
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(Group group_, ColumnParallelLinearOptions options_)
    : options(std::move(options_)), group(std::move(group_)) {
  reset();
}

void ColumnParallelLinearImpl::reset() {
  auto shards = column_parallel_shards(group, options.in_features(), options.out_features(), options.bias(),
                                       options.name());
  weight = register_parameter("weight", shards.weight);
  bias = register_parameter("bias", shards.bias, /*requires_grad=*/options.bias());
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  return column_parallel_linear(input, weight, bias, group, options.gather_output(), options.sequence_parallel(),
                                options.name());
}

RowParallelLinearImpl::RowParallelLinearImpl(Group group_, RowParallelLinearOptions options_)
    : options(std::move(options_)), group(std::move(group_)) {
  TORCH_CHECK(!options.sequence_parallel() || options.input_is_parallel(), options.name(),
              ": sequence_parallel needs input_is_parallel (the input of a ColumnParallelLinear's output)");
  reset();
}

void RowParallelLinearImpl::reset() {
  auto shards = row_parallel_shards(group, options.in_features(), options.out_features(), options.bias(),
                                    options.name());
  weight = register_parameter("weight", shards.weight);
  bias = register_parameter("bias", shards.bias, /*requires_grad=*/options.bias());
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  return row_parallel_linear(input, weight, bias, group, options.input_is_parallel(), options.sequence_parallel(),
                             options.name());
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(Group group_, VocabParallelEmbeddingOptions options_)
    : options(std::move(options_)), group(std::move(group_)) {
  reset();
}

void VocabParallelEmbeddingImpl::reset() {
  weight = register_parameter(
      "weight", vocab_parallel_shard(group, options.num_embeddings(), options.embedding_dim(), options.name()));
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  return vocab_parallel_embedding(ids, weight, group, options.num_embeddings(), options.sequence_parallel(),
                                  options.name());
}

} // namespace torchpar::tensor_parallel
