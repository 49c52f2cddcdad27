// common/gradient_hooks: the callback DDP's reducer and RemoteParameters start communication from
// (in-process, one backward at a time).
#include "catch_with_torch.h"
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <torch/csrc/autograd/autograd.h>

#include <torchpar/common/gradient_hooks.h>

#include <memory>
#include <stdexcept>

using Catch::Matchers::Contains;

namespace {

struct TwoLayers {
  at::Tensor first = at::ones({3}).requires_grad_(true);
  at::Tensor second = at::full({3}, 2.0).requires_grad_(true);
  void backward() const {
    auto hidden = first * 2;
    auto loss = (hidden * second * 5).sum();
    torch::autograd::backward({loss});
  }
};

} // namespace

TEST_CASE("gradient hooks: each parameter's callback runs once per backward, with .grad already final",
          "[common]") {
  TwoLayers model;
  std::vector<size_t> calls;
  std::vector<double> grad_sums;
  torchpar::GradientReadyHooks hooks({model.first, model.second}, [&](size_t index) {
    calls.push_back(index);
    const auto& parameter = index == 0 ? model.first : model.second;
    grad_sums.push_back(parameter.grad().defined() ? parameter.grad().sum().item<double>() : -1.0);
  });
  model.backward();
  REQUIRE(calls.size() == 2);
  CHECK(calls[0] != calls[1]);
  // d loss / d first = 10 * second (20 each, 60 in all); d loss / d second = 10 * first (30 in all).
  const auto expected = [](size_t index, double backwards) { return (index == 0 ? 60.0 : 30.0) * backwards; };
  CHECK(grad_sums[0] == expected(calls[0], 1));
  CHECK(grad_sums[1] == expected(calls[1], 1));
  model.backward();
  REQUIRE(calls.size() == 4);
  CHECK(grad_sums[3] == expected(calls[3], 2));  // accumulated: the callback sees the sum
}

TEST_CASE("gradient hooks: destroying them removes every hook", "[common]") {
  TwoLayers model;
  int calls = 0;
  {
    torchpar::GradientReadyHooks hooks({model.first, model.second}, [&](size_t) { ++calls; });
  }
  model.backward();
  CHECK(calls == 0);
  CHECK(model.first.grad().defined());
}

TEST_CASE("gradient hooks: a callback's exception fails backward with its message", "[common]") {
  TwoLayers model;
  torchpar::GradientReadyHooks hooks({model.first, model.second},
                                     [](size_t index) { throw std::runtime_error("refused gradient " + std::to_string(index)); });
  CHECK_THROWS_WITH(model.backward(), Contains("refused gradient"));
}

TEST_CASE("gradient hooks: a tensor that is not a leaf requiring grad is refused", "[common]") {
  const auto leaf = at::ones({2}).requires_grad_(true);
  CHECK_THROWS_WITH(torchpar::GradientReadyHooks({leaf * 2}, [](size_t) {}),
                    Contains("parameter 0 is not a leaf tensor that requires grad"));
  CHECK_THROWS_WITH(torchpar::GradientReadyHooks({at::ones({2})}, [](size_t) {}),
                    Contains("parameter 0 is not a leaf tensor that requires grad"));
}
