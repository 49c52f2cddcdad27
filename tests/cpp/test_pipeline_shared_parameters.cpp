// pipeline/shared_parameters and shared_gradients: tied parameters across stages. In one process, how
// ties are found, merged and placed; on forked ranks, a model whose embedding matrix is also its
// output layer's, found (built layers) or declared (factories), against single-process training.
#include <cmath>
#include <map>
#include <unordered_set>

#include "catch_with_torch.h"
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tanh.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <torchpar/common/control_collectives.h>
#include <torchpar/pipeline/partition.h>
#include <torchpar/pipeline/pipeline.h>
#include <torchpar/pipeline/shared_parameters.h>

#include "harness.h"

namespace pp = torchpar::pipeline;
using torchpar::testing::run_on_ranks;
using Catch::Matchers::Contains;

namespace {

pp::Layer holding(const std::string& name, pp::Tensors parameters, std::vector<std::string> names = {}) {
  return pp::Layer{name, [](const pp::Tensors& x) { return x; }, std::move(parameters), std::move(names)};
}

constexpr int64_t kVocab = 11, kWidth = 8, kLayers = 8;
constexpr double kLr = 0.1;

// Layer `index` of an 8-layer model: an embedding, Linear/Tanh, and an output layer computing logits
// against `head` (the embedding's matrix to tie them, or its own).
pp::Layer model_layer(int64_t index, const at::Tensor& head = {}) {
  torch::manual_seed(100 + index);
  if (index == 0) {
    auto table = at::randn({kVocab, kWidth}).requires_grad_(true);
    return {"embedding", [table](const pp::Tensors& x) { return pp::Tensors{at::embedding(table, x[0])}; },
            {table}, {"weight"}};
  }
  if (index == kLayers - 1) {
    auto weight = head.defined() ? head : at::randn({kVocab, kWidth}).requires_grad_(true);
    return {"head", [weight](const pp::Tensors& x) { return pp::Tensors{at::matmul(x[0], weight.t())}; },
            {weight}, {"weight"}};
  }
  if (index % 2 == 0) {
    return {"tanh", [](const pp::Tensors& x) { return pp::Tensors{at::tanh(x[0])}; }, {}};
  }
  return pp::layer_from_module("linear", torch::nn::AnyModule(torch::nn::Linear(kWidth, kWidth)));
}

// The model with its output layer tied to its embedding: one tensor in layers 0 and 7.
std::vector<pp::Layer> tied_model() {
  std::vector<pp::Layer> layers{model_layer(0)};
  for (int64_t i = 1; i < kLayers; ++i) {
    layers.push_back(model_layer(i, layers[0].parameters[0]));
  }
  return layers;
}

std::vector<at::Tensor> unique_parameters(const std::vector<pp::Layer>& layers) {
  std::vector<at::Tensor> unique;
  std::unordered_set<const void*> seen;
  for (const auto& layer : layers) {
    for (const auto& parameter : layer.parameters) {
      if (seen.insert(parameter.unsafeGetTensorImpl()).second) {
        unique.push_back(parameter);
      }
    }
  }
  return unique;
}

at::Tensor cross_entropy(const pp::Tensors& outputs, const at::Tensor& target) {
  return at::cross_entropy_loss(outputs[0], target);
}

struct Batch {
  at::Tensor inputs, target;
};

std::vector<Batch> batches() {
  torch::manual_seed(7);
  std::vector<Batch> result;
  for (int i = 0; i < 2; ++i) {
    result.push_back({at::randint(0, kVocab, {8}), at::randint(0, kVocab, {8})});
  }
  return result;
}

// Two SGD steps (with momentum, whose state must stay equal too) of the whole model in one process:
// the losses and the layers after them.
std::pair<std::vector<double>, std::vector<pp::Layer>> reference_training() {
  auto layers = tied_model();
  torch::optim::SGD optimizer(unique_parameters(layers), torch::optim::SGDOptions(kLr).momentum(0.9));
  std::vector<double> losses;
  for (const auto& batch : batches()) {
    optimizer.zero_grad();
    pp::Tensors x{batch.inputs};
    for (const auto& layer : layers) {
      x = layer.forward(x);
    }
    auto loss = at::cross_entropy_loss(x[0], batch.target);
    loss.backward();
    optimizer.step();
    losses.push_back(loss.item<double>());
  }
  return {losses, layers};
}

} // namespace

TEST_CASE("pipeline shared parameters: a tensor two layers list is found, addressed as the layers name it") {
  const auto w = at::randn({2}), b = at::randn({2}), v = at::randn({3});
  const std::vector<pp::Layer> layers{holding("a", {w, b}, {"w", "b"}), holding("relu", {}), holding("c", {w}),
                                      holding("d", {v, w}), holding("e", {v})};
  const auto found = pp::detect_shared_parameters(layers);
  REQUIRE(found.size() == 2);
  CHECK(found[0] == pp::SharedParameterGroup{{0, "w"}, {2, int64_t(0)}, {3, int64_t(1)}});
  CHECK(found[1] == pp::SharedParameterGroup{{3, int64_t(0)}, {4, int64_t(0)}});
  CHECK(pp::describe(found[0]) == "layer 0 'w' = layer 2 parameter 0 = layer 3 parameter 1");
  // A layer listing one tensor twice ties nothing.
  CHECK(pp::detect_shared_parameters({holding("twice", {w, w})}).empty());
}

TEST_CASE("pipeline shared parameters: declared groups merge with what is found, in one order on every rank") {
  const auto w = at::randn({2}), x = at::randn({2});
  const std::vector<pp::Layer> layers{holding("a", {w}, {"weight"}), holding("b", {x}, {"weight"}),
                                      holding("c", {x}, {"weight"}), holding("d", {w}, {"weight"})};
  // Declared by position, found by name: the same parameter, one group.
  const auto merged = pp::shared_parameters_of(layers, {{{3, int64_t(0)}, {0, int64_t(0)}}});
  CHECK(merged == std::vector<pp::SharedParameterGroup>{{{0, "weight"}, {3, "weight"}}, {{1, "weight"}, {2, "weight"}}});
  // Groups with a member in common are one group.
  CHECK(pp::merge_shared_parameters({{{5, "c"}, {3, "b"}}, {{1, int64_t(0)}, {2, int64_t(0)}}, {{0, "a"}, {3, "b"}}}, 6) ==
        std::vector<pp::SharedParameterGroup>{{{0, "a"}, {3, "b"}, {5, "c"}}, {{1, int64_t(0)}, {2, int64_t(0)}}});
  CHECK_THROWS_WITH(pp::shared_parameters_of(layers, {{{0, "weight"}, {1, "wieght"}}}),
                    Contains("layer 1 'wieght' does not exist: layer 1 (b) has parameters 'weight'"));
  CHECK_THROWS_WITH(pp::shared_parameters_of(layers, {{{0, "weight"}, {1, int64_t(3)}}}),
                    Contains("layer 1 parameter 3 does not exist: layer 1 (b) has 1 parameters"));
  CHECK_THROWS_WITH(pp::merge_shared_parameters({{{0, "weight"}, {9, "weight"}}}, 4),
                    Contains("layer 9 'weight' is outside the model's 4 layers"));
  CHECK_THROWS_WITH(pp::shared_parameters_of(layers, {{{0, "weight"}, {0, int64_t(0)}}}),
                    Contains("needs at least two different parameters, got layer 0 'weight' = layer 0 'weight'"));
}

TEST_CASE("pipeline shared parameters: where the copies live, and whose values they start from") {
  // 8 layers, 4 stages of 2 on 2 ranks (interleaved): stage s on rank s % 2.
  const auto boundaries = pp::stage_boundaries({2, 2, 2, 2});
  auto placement = pp::place_shared_parameters({{0, "weight"}, {7, "weight"}}, boundaries, 2);
  CHECK(placement.stages == std::vector<int>{0, 3});
  CHECK(placement.ranks == std::vector<int>{0, 1});
  CHECK(placement.source == 0);
  placement = pp::place_shared_parameters({{3, "weight"}, {4, "weight"}}, boundaries, 2);
  CHECK(placement.stages == std::vector<int>{1, 2});
  CHECK(placement.source == 1);  // layer 3 is stage 1's
  placement = pp::place_shared_parameters({{0, "weight"}, {5, "weight"}}, boundaries, 2);
  CHECK(placement.ranks == std::vector<int>{0});  // stages 0 and 2: one rank, one tensor
}

TEST_CASE("C++ pipeline with an embedding tied to the output layer equals single-process training") {
  run_on_ranks(2, [](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    const auto [expected_losses, reference] = reference_training();
    const std::vector<std::pair<std::string, int>> schedules{{"gpipe", 1}, {"1f1b", 1}, {"zero_bubble", 1},
                                                             {"interleaved", 2}};
    for (const auto& [schedule, virtual_stages] : schedules) {
      for (const bool declared : {false, true}) {
        INFO(schedule << (declared ? ", tie declared, layers from factories" : ", tie found") << ", rank " << rank);
        auto options = pp::PipelineOptions().process_group(pg).schedule(schedule).microbatches(4)
                           .virtual_stages(virtual_stages);
        std::map<int64_t, pp::Layer> built;
        std::unique_ptr<pp::Pipeline> pipe;
        if (declared) {
          // Each rank builds its own layers: the head's matrix starts with its own values.
          std::vector<pp::LayerFactory> factories;
          for (int64_t i = 0; i < kLayers; ++i) {
            factories.push_back([i, &built] { return built[i] = model_layer(i); });
          }
          options.shared_parameters({{{0, "weight"}, {kLayers - 1, int64_t(0)}}});
          pipe = std::make_unique<pp::Pipeline>(factories, cross_entropy, options);
        } else {
          auto layers = tied_model();
          if (rank == 1) {  // this rank's copy starts elsewhere: the pipeline starts it from layer 0's rank
            torch::NoGradGuard no_grad;
            layers[0].parameters[0].add_(1.0);
          }
          for (int64_t i = 0; i < kLayers; ++i) {
            built.emplace(i, layers[i]);
          }
          pipe = std::make_unique<pp::Pipeline>(layers, cross_entropy, options);
        }
        REQUIRE(pipe->shared_parameters().size() == 1);
        const auto boundaries = pp::stage_boundaries(pipe->balance());
        std::vector<pp::Layer> own;
        for (int stage : pipe->stages()) {
          for (int64_t layer = boundaries[stage]; layer < boundaries[stage + 1]; ++layer) {
            own.push_back(built.at(layer));
          }
        }
        CHECK(pipe->parameters().size() == unique_parameters(own).size());

        torch::optim::SGD optimizer(pipe->parameters(), torch::optim::SGDOptions(kLr).momentum(0.9));
        size_t step = 0;
        for (const auto& batch : batches()) {
          optimizer.zero_grad();
          const auto loss = pipe->step(batch.inputs, batch.target);
          optimizer.step();
          CHECK(std::abs(loss.item<double>() - expected_losses[step++]) < 1e-5);
        }
        for (int stage : pipe->stages()) {
          for (int64_t layer = boundaries[stage]; layer < boundaries[stage + 1]; ++layer) {
            for (size_t p = 0; p < built.at(layer).parameters.size(); ++p) {
              INFO("layer " << layer << " parameter " << p);
              CHECK((built.at(layer).parameters[p] - reference[layer].parameters[p]).abs().max().item<double>() < 1e-5);
            }
          }
        }
        // Both ranks hold one copy of the tied matrix (layer 0's on rank 0, layer 7's on rank 1): equal.
        const auto& copy = built.at(rank == 0 ? 0 : kLayers - 1).parameters[0];
        const auto copies = torchpar::all_gather(*pg, copy.detach(), at::kCPU);
        CHECK(copies[0].equal(copies[1]));
      }
    }
  });
}

TEST_CASE("C++ pipeline refuses, on every rank, a tie between copies of different shapes") {
  run_on_ranks(2, [](int, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    std::vector<pp::LayerFactory> factories{
        [] { return model_layer(0); },
        [] { return pp::layer_from_module("out", torch::nn::AnyModule(torch::nn::Linear(kWidth, 5))); }};
    CHECK_THROWS_WITH(pp::Pipeline(factories, cross_entropy,
                                   pp::PipelineOptions().process_group(pg).shared_parameters({{{0, "weight"}, {1, "weight"}}})),
                      Contains("the tied parameters layer 0 'weight' = layer 1 'weight' differ across the pipeline "
                               "ranks holding them: rank 0 has [11, 8] Float, rank 1 has [5, 8] Float"));
  });
}
