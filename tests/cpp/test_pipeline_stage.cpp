// pipeline/stage: one stage's forward and backward passes on micro-batches, in one process (no ranks):
// each pass against plain autograd over the same layers.
#include "catch_with_torch.h"
#include <ATen/ops/allclose.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tanh.h>
#include <torch/csrc/autograd/autograd.h>

#include <torchpar/pipeline/stage.h>

namespace pipeline = torchpar::pipeline;
using Catch::Matchers::Contains;

namespace {

// Two linear layers with a tanh (and dropout, whose mask must be the same when recomputed).
struct Model {
  at::Tensor w1 = at::randn({6, 4}).requires_grad_(true);
  at::Tensor w2 = at::randn({3, 6}).requires_grad_(true);
  double dropout = 0.0;

  std::vector<pipeline::Layer> layers() const {
    return {{"hidden", [this](const pipeline::Tensors& x) {
               return pipeline::Tensors{at::dropout(at::tanh(at::linear(x[0], w1)), dropout, true)};
             }, {w1}},
            {"out", [this](const pipeline::Tensors& x) { return pipeline::Tensors{at::linear(x[0], w2)}; }, {w2}}};
  }
  void zero_grad() {
    w1.mutable_grad() = at::Tensor();
    w2.mutable_grad() = at::Tensor();
  }
};

pipeline::LossFn mean_squared = [](const pipeline::Tensors& outputs, const at::Tensor& target) {
  return (outputs[0] - target).pow(2).mean();
};

struct Gradients {
  at::Tensor input, w1, w2;
};

// Plain autograd: the loss of one micro-batch, scaled, and every gradient.
Gradients reference(Model& model, const at::Tensor& x, const at::Tensor& target, double scale) {
  model.zero_grad();
  auto input = x.detach().requires_grad_(true);
  auto out = model.layers()[1].forward(model.layers()[0].forward({input}))[0];
  (mean_squared({out}, target) * scale).backward();
  return {input.grad(), model.w1.grad().clone(), model.w2.grad().clone()};
}

} // namespace

TEST_CASE("pipeline stage: a last stage's forward and backward equal autograd, every kind of backward",
          "[pipeline]") {
  const bool split = GENERATE(false, true);
  const bool checkpoint = GENERATE(false, true);
  INFO("split backward " << split << ", activation checkpointing " << checkpoint);
  at::manual_seed(0);
  Model model;
  model.dropout = 0.3;
  const auto x = at::randn({5, 4});
  const auto target = at::randn({5, 3});

  pipeline::PipelineStage stage(1, 4, model.layers(), checkpoint, split, mean_squared);
  auto generator = at::detail::getDefaultCPUGenerator();
  const auto generator_before = generator.get_state();
  auto input = x.clone().requires_grad_(true);
  const auto loss = stage.forward(7, {input}, target, 0.25);
  pipeline::Tensors input_grads;
  if (split) {
    input_grads = stage.backward_input(7, {});
    CHECK_FALSE(model.w1.grad().defined());  // weights wait for backward_weight
    stage.backward_weight(7);
  } else {
    input_grads = stage.backward(7, {});
  }
  const auto w1 = model.w1.grad().clone();
  const auto w2 = model.w2.grad().clone();

  // The same dropout mask: the generator as it was before the stage's forward.
  generator.set_state(generator_before);
  const auto expected = reference(model, x, target, 0.25);
  REQUIRE(input_grads.size() == 1);
  CHECK(at::allclose(input_grads[0], expected.input, 1e-6, 1e-6));
  CHECK(at::allclose(w1, expected.w1, 1e-6, 1e-6));
  CHECK(at::allclose(w2, expected.w2, 1e-6, 1e-6));
  CHECK(loss.size() == 1);
}

TEST_CASE("pipeline stage: a middle stage returns detached outputs and takes its output gradients",
          "[pipeline]") {
  at::manual_seed(1);
  Model model;
  pipeline::PipelineStage stage(0, 0, model.layers(), false, false);
  const auto x = at::randn({2, 4});
  const auto outputs = stage.forward(0, {x});
  REQUIRE(outputs.size() == 1);
  CHECK_FALSE(outputs[0].requires_grad());  // ready to send: no graph across the boundary
  const auto output_grad = at::randn({2, 3});
  const auto input_grads = stage.backward(0, {output_grad});
  CHECK_FALSE(input_grads.at(0).defined());  // the first stage's input takes no gradient
  const auto w1 = model.w1.grad().clone();
  const auto w2 = model.w2.grad().clone();

  const auto direct = model.layers()[1].forward(model.layers()[0].forward({x}))[0];
  const auto expected = torch::autograd::grad({direct}, {model.w1, model.w2}, {output_grad});
  CHECK(at::allclose(w1, expected[0], 1e-6, 1e-6));
  CHECK(at::allclose(w2, expected[1], 1e-6, 1e-6));
}

TEST_CASE("pipeline stage: passes out of order are refused, naming the stage and the micro-batch", "[pipeline]") {
  Model model;
  pipeline::PipelineStage stage(2, 5, model.layers(), false, false, mean_squared);
  CHECK(stage.describe() == "stage 2 (layers 5-6)");
  CHECK_THROWS_WITH(stage.backward(3, {}),
                    Contains("pipeline stage 2 (layers 5-6), micro-batch 3: backward before its forward"));
  stage.forward(3, {at::randn({1, 4})}, at::randn({1, 3}));
  CHECK_THROWS_WITH(stage.forward(3, {at::randn({1, 4})}, at::randn({1, 3})),
                    Contains("micro-batch 3: forward ran twice without a backward"));
  CHECK_THROWS_WITH(stage.backward_input(3, {}), Contains("split backward on a stage built for full backward"));
  stage.discard_in_flight();
  CHECK_THROWS_WITH(stage.backward(3, {}), Contains("micro-batch 3: backward before its forward"));
}

TEST_CASE("pipeline stage: a layer's error names the stage, the micro-batch and the layer", "[pipeline]") {
  Model model;
  pipeline::PipelineStage stage(1, 2, model.layers(), false, false, mean_squared);
  CHECK_THROWS_WITH(stage.forward(0, {at::randn({2, 5})}, at::randn({2, 3})),
                    Contains("pipeline stage 1 (layers 2-3), micro-batch 0: layer 2 (hidden)"));
}
