// The planner's profile of LibTorch modules: which layers a tensor group can split and which embedding tables a
// parameter server can hold as sparse rows, found from the modules as Python's planner finds them.
#include "catch_with_torch.h"
#include <ATen/ops/randint.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <torchpar/pipeline/layer.h>
#include <torchpar/plan/profile.h>

namespace nn = torch::nn;
namespace pipeline = torchpar::pipeline;

namespace {

pipeline::LayerFactory factory(std::function<nn::AnyModule()> make) {
  return [make = std::move(make)] { return pipeline::layer_from_module("layer", make()); };
}

} // namespace

TEST_CASE("plan profile: Linear layers, activations and the first layer's embedding tables found in LibTorch modules") {
  const std::vector<pipeline::LayerFactory> factories{
      factory([] { return nn::AnyModule(nn::EmbeddingBag(nn::EmbeddingBagOptions(1000, 16).mode(torch::kMean))); }),
      factory([] { return nn::AnyModule(nn::Linear(16, 32)); }),
      factory([] { return nn::AnyModule(nn::ReLU()); }),
      factory([] { return nn::AnyModule(nn::Linear(32, 8)); }),
      factory([] { return nn::AnyModule(nn::Linear(8, 4)); }),
  };
  // Eight samples of three ids each.
  const auto model = torchpar::plan::profile_layers(factories, {at::randint(1000, {8, 3})}, /*repeats=*/1);
  REQUIRE(model.layers.size() == 5);
  CHECK(model.layers[0].sparse_parameter_bytes == 1000 * 16 * 4);
  CHECK(model.layers[0].sparse_bytes_per_sample == 3 * 16 * 4);
  CHECK(model.layers[0].in_features == 0);
  CHECK(model.layers[1].in_features == 16);
  CHECK(model.layers[1].out_features == 32);
  CHECK(model.layers[2].elementwise);
  CHECK(model.layers[2].in_features == 0);
  CHECK(model.layers[3].in_features == 32);
  CHECK(model.layers[3].out_features == 8);
  CHECK_FALSE(model.layers[3].elementwise);
  // A plain Linear runs as the pipeline's own linear layer, adding its weight gradient in itself.
  CHECK(model.layers[1].accumulates_weight_gradient);
  CHECK(model.layers[3].accumulates_weight_gradient);
  CHECK_FALSE(model.layers[0].accumulates_weight_gradient);
  CHECK_FALSE(model.layers[2].accumulates_weight_gradient);
  // Only the first layer is fed the model's ids.
  for (size_t i = 1; i < model.layers.size(); ++i) CHECK(model.layers[i].sparse_parameter_bytes == 0);
  // The ReLU runs on the split between a column- and a row-parallel layer; the last Linear alone is gathered.
  using Role = torchpar::plan::TensorRole;
  const auto roles = torchpar::plan::tensor_parallel_roles(model);
  CHECK((roles == std::vector<Role>{Role::Whole, Role::Column, Role::Elementwise, Role::Row, Role::ColumnGathered}));
}

TEST_CASE("plan profile: a Sequential of a Linear and activations splits, and a max over rows gives no sparse rows") {
  const auto bag = nn::EmbeddingBag(nn::EmbeddingBagOptions(100, 4).mode(torch::kMax));
  CHECK(pipeline::traits_of(*bag).embedding_bytes == 0);
  const auto table = nn::Embedding(100, 4);
  const auto traits = pipeline::traits_of(*nn::Sequential(table, nn::Linear(4, 2)));
  CHECK(traits.embedding_bytes == 100 * 4 * 4);
  CHECK(traits.embedding_row_bytes == 4 * 4);
  CHECK(traits.split_in_features == 0);
  const auto block = pipeline::traits_of(*nn::Sequential(nn::Linear(4, 6), nn::GELU(), nn::Dropout(0.1)));
  CHECK(block.split_in_features == 4);
  CHECK(block.split_out_features == 6);
  CHECK_FALSE(block.elementwise);
  CHECK(pipeline::traits_of(*nn::Sequential(nn::Linear(4, 6), nn::Linear(6, 2))).split_in_features == 0);
  // Only a plain Linear accumulates its weight gradient itself; any other layer leaves it to autograd.
  CHECK(pipeline::layer_from_module("linear", nn::AnyModule(nn::Linear(4, 6))).accumulates_weight_gradient);
  CHECK_FALSE(pipeline::layer_from_module("norm", nn::AnyModule(nn::LayerNorm(nn::LayerNormOptions({6}))))
                  .accumulates_weight_gradient);
}
