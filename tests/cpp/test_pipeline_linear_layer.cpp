// pipeline/linear_layer: the linear layer that adds its weight gradient into .grad itself, against
// at::linear under plain autograd: every gradient, and every way autograd may be asked for them.
#include "catch_with_torch.h"
#include <ATen/autocast_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randn.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/linear.h>

#include <torchpar/pipeline/linear_layer.h>

namespace pipeline = torchpar::pipeline;

namespace {

struct Parameters {
  at::Tensor weight = at::randn({3, 4}).requires_grad_(true);
  at::Tensor bias = at::randn({3}).requires_grad_(true);

  Parameters copy() const {
    return {weight.detach().clone().requires_grad_(true), bias.detach().clone().requires_grad_(true)};
  }
};

at::Tensor plain(const at::Tensor& x, const Parameters& p) { return at::linear(x, p.weight, p.bias); }
at::Tensor fused(const at::Tensor& x, const Parameters& p) {
  return pipeline::linear_accumulating_weight_gradient(x, p.weight, p.bias);
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() == b.defined() && (!a.defined() || at::allclose(a, b, 1e-5, 1e-6));
}

} // namespace

TEST_CASE("pipeline linear layer: gradients equal autograd's, accumulated over backwards, any input rank",
          "[pipeline]") {
  at::manual_seed(0);
  const bool with_bias = GENERATE(true, false);
  const auto shape = GENERATE(std::vector<int64_t>{5, 4}, std::vector<int64_t>{2, 5, 4});
  INFO("bias " << with_bias << ", input rank " << shape.size());
  Parameters reference;
  Parameters ours = reference.copy();
  if (!with_bias) {
    reference.bias = ours.bias = at::Tensor();
  }
  for (int micro_batch = 0; micro_batch < 3; ++micro_batch) {  // the first creates .grad, the others add to it
    const auto x = at::randn(shape);
    auto output_shape = shape;
    output_shape.back() = 3;
    const auto upstream = at::randn(output_shape);
    auto x_plain = x.clone().requires_grad_(true);
    auto x_fused = x.clone().requires_grad_(true);
    plain(x_plain, reference).backward(upstream);
    fused(x_fused, ours).backward(upstream);
    CHECK(same(x_fused.grad(), x_plain.grad()));
    CHECK(same(ours.weight.grad(), reference.weight.grad()));
    if (with_bias) {
      CHECK(same(ours.bias.grad(), reference.bias.grad()));
    }
  }
}

TEST_CASE("pipeline linear layer: split backward, grad() and create_graph see autograd's semantics", "[pipeline]") {
  at::manual_seed(1);
  Parameters reference;
  Parameters ours = reference.copy();
  const auto x = at::randn({5, 4});
  const auto upstream = at::randn({5, 3});

  SECTION("input gradients only, then weight gradients only (ZB-H1's I and W passes)") {
    ours.weight.mutable_grad() = at::ones({3, 4});  // earlier micro-batches' sum
    const auto before = ours.weight.grad().clone();
    auto input = x.clone().requires_grad_(true);
    const auto out = fused(input, ours);
    const auto input_gradient = torch::autograd::grad({out}, {input}, {upstream}, /*retain_graph=*/true)[0];
    CHECK(at::equal(ours.weight.grad(), before));  // the I pass leaves the weights alone
    CHECK_FALSE(ours.bias.grad().defined());
    torch::autograd::backward({out}, {upstream}, /*keep_graph=*/false, /*create_graph=*/false,
                              {ours.weight, ours.bias});
    CHECK_FALSE(input.grad().defined());

    auto reference_input = x.clone().requires_grad_(true);
    plain(reference_input, reference).backward(upstream);
    CHECK(same(input_gradient, reference_input.grad()));
    CHECK(same(ours.weight.grad(), reference.weight.grad() + before));
    CHECK(same(ours.bias.grad(), reference.bias.grad()));
  }
  SECTION("grad() returns the weight gradient and leaves .grad alone") {
    const auto gradients = torch::autograd::grad({fused(x, ours)}, {ours.weight, ours.bias}, {upstream});
    CHECK_FALSE(ours.weight.grad().defined());
    CHECK_FALSE(ours.bias.grad().defined());
    const auto expected = torch::autograd::grad({plain(x, reference)}, {reference.weight, reference.bias}, {upstream});
    CHECK(same(gradients[0], expected[0]));
    CHECK(same(gradients[1], expected[1]));
  }
  SECTION("create_graph: the weight gradient can be differentiated again") {
    auto input = x.clone().requires_grad_(true);  // the weight gradient, upstream^T x, depends on it
    const auto gradient =
        torch::autograd::grad({fused(input, ours)}, {ours.weight}, {upstream}, std::nullopt, /*create_graph=*/true)[0];
    REQUIRE(gradient.requires_grad());
    CHECK_FALSE(ours.weight.grad().defined());
    auto reference_input = x.clone().requires_grad_(true);
    const auto expected =
        torch::autograd::grad({plain(reference_input, reference)}, {reference.weight}, {upstream}, std::nullopt, true)[0];
    CHECK(same(gradient, expected));
    CHECK(same(torch::autograd::grad({gradient.sum()}, {input})[0],
               torch::autograd::grad({expected.sum()}, {reference_input})[0]));
  }
}

TEST_CASE("pipeline linear layer: a hook on the weight sees and changes its gradient as under autograd",
          "[pipeline]") {
  at::manual_seed(2);
  Parameters reference;
  Parameters ours = reference.copy();
  int calls = 0;
  for (auto* p : {&reference, &ours}) {
    p->weight.mutable_grad() = at::ones({3, 4});
    p->weight.register_hook([&calls](const at::Tensor& g) {
      ++calls;
      return g * 2;
    });
  }
  const auto x = at::randn({5, 4});
  plain(x, reference).sum().backward();
  fused(x, ours).sum().backward();
  CHECK(calls == 2);
  CHECK(same(ours.weight.grad(), reference.weight.grad()));
}

TEST_CASE("pipeline linear layer: layer_from_module builds it for torch::nn::Linear", "[pipeline]") {
  torch::nn::Linear module(4, 3);
  const auto layer = pipeline::layer_from_module("fc", torch::nn::AnyModule(module));
  REQUIRE(layer.parameters.size() == 2);
  const auto out = layer.forward({at::randn({2, 4})})[0];
  CHECK(out.grad_fn()->name().find("LinearAccumulatingWeightGradient") != std::string::npos);
}

TEST_CASE("pipeline linear layer: under autocast it runs as autograd's linear, in the lower precision", "[pipeline]") {
  torch::nn::Linear module(4, 3);
  const auto layer = pipeline::linear_layer("fc", module->weight, module->bias);
  const auto x = at::randn({2, 4}).requires_grad_(true);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  const auto out = layer.forward({x})[0];
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  CHECK(out.scalar_type() == at::autocast::get_autocast_dtype(at::kCPU));
  out.sum().backward();
  CHECK(module->weight.grad().scalar_type() == at::kFloat);
  CHECK(x.grad().defined());
}
