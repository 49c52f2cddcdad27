// pipeline/microbatches: how a batch is cut into micro-batches, and step's check (pure, in-process).
#include "catch_with_torch.h"
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>

#include <torchpar/pipeline/microbatches.h>

namespace pp = torchpar::pipeline;
using Catch::Matchers::Contains;

namespace {

std::vector<int64_t> microbatch_sizes(const std::vector<pp::Tensors>& parts, size_t tensor) {
  std::vector<int64_t> sizes;
  for (const auto& part : parts) {
    sizes.push_back(part.at(tensor).size(0));
  }
  return sizes;
}

} // namespace

TEST_CASE("micro-batches: contiguous parts of every tensor, the first ones a sample larger when uneven") {
  const auto samples = at::arange(10);
  const auto features = at::arange(20).reshape({10, 2});
  SECTION("even") {
    const auto parts = pp::split_microbatches({at::arange(12), at::arange(24).reshape({12, 2})}, 4);
    REQUIRE(parts.size() == 4);
    CHECK(microbatch_sizes(parts, 0) == std::vector<int64_t>{3, 3, 3, 3});
    CHECK(microbatch_sizes(parts, 1) == std::vector<int64_t>{3, 3, 3, 3});
    CHECK(parts[2][0].equal(at::arange(6, 9)));
    CHECK(parts[2][1].equal(at::arange(12, 18).reshape({3, 2})));
  }
  SECTION("uneven") {
    const auto parts = pp::split_microbatches({samples, features}, 4);
    CHECK(microbatch_sizes(parts, 0) == std::vector<int64_t>{3, 3, 2, 2});
    CHECK(parts[1][0].equal(at::arange(3, 6)));
    CHECK(parts[3][1].equal(at::arange(16, 20).reshape({2, 2})));
    CHECK(at::cat({parts[0][1], parts[1][1], parts[2][1], parts[3][1]}).equal(features));
  }
  SECTION("fewer samples than micro-batches") {
    const auto parts = pp::split_microbatches({at::arange(2)}, 4);
    CHECK(microbatch_sizes(parts, 0) == std::vector<int64_t>{1, 1, 0, 0});
    CHECK(parts[1][0].equal(at::arange(1, 2)));
  }
  SECTION("an empty batch") {
    CHECK(microbatch_sizes(pp::split_microbatches({at::zeros({0, 3})}, 3), 0) == std::vector<int64_t>{0, 0, 0});
  }
  SECTION("no tensors") {
    const auto parts = pp::split_microbatches({}, 3);
    REQUIRE(parts.size() == 3);
    CHECK(parts[0].empty());
  }
}

TEST_CASE("micro-batches: step's check refuses batches that do not split equally, naming the tensor") {
  CHECK_NOTHROW(pp::check_equal_microbatches({at::zeros({12, 2}), at::zeros({12})}, 4, "step", "input"));
  CHECK_NOTHROW(pp::check_equal_microbatches({at::zeros({0, 2})}, 4, "step", "input"));
  CHECK_THROWS_WITH(pp::check_equal_microbatches({at::zeros({12, 2}), at::zeros({10, 4})}, 4, "step", "input"),
                    Contains("pipeline.step: a batch of 10 samples (input 1 [10, 4] Float) does not split into 4 "
                             "equal micro-batches; use a batch size divisible by 4"));
  CHECK_THROWS_WITH(pp::check_equal_microbatches({at::zeros({2})}, 4, "step", "target"),
                    Contains("a batch of 2 samples (target 0 [2] Float)"));
  CHECK_THROWS_WITH(pp::check_equal_microbatches({at::zeros({})}, 2, "step", "input"),
                    Contains("pipeline.step: input 0 must be a tensor with a batch dimension"));
  CHECK_THROWS_WITH(pp::check_equal_microbatches({at::Tensor()}, 2, "step", "target"),
                    Contains("pipeline.step: target 0 must be a tensor with a batch dimension"));
}
