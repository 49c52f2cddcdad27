#include <torchpar/tensor_parallel/layers.h>

#include <torchpar/common/hash.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/tensor.h>
#include <c10/core/GradMode.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstring>
#include <mutex>
#include <sstream>
#include <utility>
#include <vector>

namespace torchpar::tensor_parallel {
namespace {

void check_divides(int64_t features, int size, const std::string& name, const char* what) {
  TORCH_CHECK(size > 0 && features % size == 0, name, ": ", what, " ", features,
              " does not divide by the tensor-parallel size ", size, "; choose ", what,
              " that is a multiple of ", size, " (or another tensor-parallel size)");
}

// A hash of a tensor's bytes. Built from the same generator state, a layer's initial values are the same
// bits on every rank; another seed, or other draws before the layer, gives other values and another hash.
// An undefined tensor (a layer without bias) hashes to 0.
int64_t fingerprint(const at::Tensor& tensor) {
  if (!tensor.defined()) return 0;
  const auto values = tensor.detach().cpu().contiguous();
  const auto* bytes = static_cast<const unsigned char*>(values.const_data_ptr());
  const size_t count = values.nbytes();
  uint64_t hash = splitmix64(count);
  size_t offset = 0;
  for (; offset + sizeof(uint64_t) <= count; offset += sizeof(uint64_t)) {
    uint64_t word;
    std::memcpy(&word, bytes + offset, sizeof(word));
    hash = splitmix64(hash ^ word);
  }
  uint64_t tail = 0;
  if (offset < count) std::memcpy(&tail, bytes + offset, count - offset);
  return static_cast<int64_t>(splitmix64(hash ^ tail));
}

using NamedValues = std::vector<std::pair<const char*, at::Tensor>>;

// One small all-gather of the layer's sizes and its full initial values' fingerprints: every rank must
// build the same layer, else shards would not fit together (and a later collective would hang or mix
// unrelated data), or would fit but hold pieces of different layers (ranks seeded differently: a
// replicated bias that differs per rank, and every rank computing another model). Returns why not, or "".
std::string layer_mismatch(const Group& group, const std::string& name, const std::vector<int64_t>& config,
                           const char* fields, const NamedValues& values) {
  const int size = group_size(group);
  auto identity = config;
  for (const auto& value : values) identity.push_back(fingerprint(value.second));
  const auto fields_count = static_cast<int64_t>(config.size());
  const auto mine = at::tensor(identity, at::kLong);
  const auto all = collectives::all_gather(mine, 0, group).view({size, static_cast<int64_t>(identity.size())});
  const auto sizes = all.narrow(1, 0, fields_count);
  if (!sizes.eq(sizes[0]).all().item<bool>()) {
    std::ostringstream ranks;
    for (int r = 0; r < size; ++r) {
      ranks << (r ? ", " : "") << "rank " << r << " [";
      for (int64_t field = 0; field < fields_count; ++field) {
        ranks << (field ? ", " : "") << sizes[r][field].item<int64_t>();
      }
      ranks << "]";
    }
    return c10::str(name, ": the ranks of the tensor-parallel group built different layers (", fields, "): ",
                    ranks.str(), "; every rank of the group must build the same layer");
  }
  const auto hashes = all.narrow(1, fields_count, static_cast<int64_t>(values.size()));
  const auto differs = hashes.ne(hashes[0]);
  if (!differs.any().item<bool>()) return "";
  std::string tensors, ranks;
  int other_ranks = 0;
  for (size_t v = 0; v < values.size(); ++v) {
    if (differs.select(1, static_cast<int64_t>(v)).any().item<bool>()) {
      tensors += (tensors.empty() ? "" : ", ") + std::string(values[v].first);
    }
  }
  for (int r = 1; r < size; ++r) {
    if (!differs[r].any().item<bool>()) continue;
    ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    ++other_ranks;
  }
  return c10::str(name, ": the ranks of the tensor-parallel group built different initial values of the layer (",
                  tensors, "): ", other_ranks == 1 ? "rank " : "ranks ", ranks, " drew other values than rank 0, so ",
                  "their shards are not one layer; seed every rank the same before building the layer ",
                  "(torch.manual_seed(0) in Python, torch::manual_seed(0) in C++), with the same random draws ",
                  "before it");
}

// The default CPU generator's state, taken before a layer draws its initial values.
at::Tensor generator_state() {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

// layer_mismatch as an error. A refused layer first puts the generator back where it was before its draws
// (`before`): the ranks drew different amounts for layers of different sizes, and a program that goes on
// after the error would find every later layer refused too.
void check_same_layer(const Group& group, const std::string& name, const std::vector<int64_t>& config,
                      const char* fields, const NamedValues& values, const at::Tensor& before) {
  if (group_size(group) == 1) return;
  const auto mismatch = layer_mismatch(group, name, config, fields, values);
  if (mismatch.empty()) return;
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(before);
  }
  TORCH_CHECK(false, mismatch);
}

} // namespace

LinearShards column_parallel_shards(const Group& group, int64_t in_features, int64_t out_features, bool bias,
                                    const std::string& name) {
  const int size = group_size(group);
  check_divides(out_features, size, name, "out_features");
  c10::NoGradGuard no_grad;
  const auto before = generator_state();
  torch::nn::Linear full(torch::nn::LinearOptions(in_features, out_features).bias(bias));
  check_same_layer(group, name, {in_features, out_features, bias}, "in_features, out_features, bias",
                   {{"weight", full->weight}, {"bias", full->bias}}, before);
  LinearShards shards;
  shards.weight = collectives::local_slice(full->weight, 0, group, name);
  if (bias) shards.bias = collectives::local_slice(full->bias, 0, group, name);
  return shards;
}

LinearShards row_parallel_shards(const Group& group, int64_t in_features, int64_t out_features, bool bias,
                                 const std::string& name) {
  const int size = group_size(group);
  check_divides(in_features, size, name, "in_features");
  c10::NoGradGuard no_grad;
  const auto before = generator_state();
  torch::nn::Linear full(torch::nn::LinearOptions(in_features, out_features).bias(bias));
  check_same_layer(group, name, {in_features, out_features, bias}, "in_features, out_features, bias",
                   {{"weight", full->weight}, {"bias", full->bias}}, before);
  LinearShards shards;
  shards.weight = collectives::local_slice(full->weight, 1, group, name);
  if (bias) shards.bias = full->bias.detach().clone();
  return shards;
}

at::Tensor vocab_parallel_shard(const Group& group, int64_t num_embeddings, int64_t embedding_dim,
                                const std::string& name) {
  const int size = group_size(group);
  check_divides(num_embeddings, size, name, "num_embeddings");
  c10::NoGradGuard no_grad;
  const auto before = generator_state();
  torch::nn::Embedding full(num_embeddings, embedding_dim);
  check_same_layer(group, name, {num_embeddings, embedding_dim}, "num_embeddings, embedding_dim",
                   {{"weight", full->weight}}, before);
  return collectives::local_slice(full->weight, 0, group, name);
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
  const auto parallel_input = input_is_parallel ? input : scatter_to_tensor_parallel(input, group, name);
  const auto partial = at::linear(parallel_input, weight);
  if (!sequence_parallel) {
    const auto output = reduce_from_tensor_parallel(partial, group);
    return bias.defined() ? output + bias : output;
  }
  // Each rank adds the bias to its own positions only: its gradient is summed over the group in backward.
  const auto output = reduce_scatter_to_sequence_parallel(partial, group, name);
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
  return sequence_parallel ? reduce_scatter_to_sequence_parallel(partial, group, name)
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
