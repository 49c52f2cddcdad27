// torchpar::pipeline's runtime from C++ on forked ranks, against single-process training of the same
// batch (the pure parts: test_pipeline_schedules.cpp, test_pipeline_microbatches.cpp).
#include <algorithm>
#include <cmath>
#include <functional>

#include "catch_with_torch.h"
#include <ATen/ops/arange.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <torchpar/comm/process_group.h>
#include <torchpar/pipeline/partition.h>
#include <torchpar/pipeline/pipeline.h>

#include "harness.h"

namespace pp = torchpar::pipeline;
using torchpar::testing::run_on_ranks;
using Catch::Matchers::Contains;

namespace {

torch::nn::Sequential make_mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16),
                               torch::nn::Tanh(), torch::nn::Linear(16, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 3));
}

at::Tensor cross_entropy(const pp::Tensors& outputs, const at::Tensor& target) {
  return at::cross_entropy_loss(outputs[0], target);
}

// This rank's parameters' gradients against those of the same layers of the single-process reference.
void check_gradients_match(const pp::Pipeline& pipe, const torch::nn::Sequential& reference) {
  const auto boundaries = pp::stage_boundaries(pipe.balance());
  std::vector<at::Tensor> expected;
  for (int stage : pipe.stages()) {
    for (int64_t layer = boundaries[stage]; layer < boundaries[stage + 1]; ++layer) {
      for (const auto& parameter : (*reference)[layer]->parameters()) {
        expected.push_back(parameter.grad());
      }
    }
  }
  const auto own = pipe.parameters();
  REQUIRE(own.size() == expected.size());
  for (size_t i = 0; i < own.size(); ++i) {
    CHECK((own[i].grad() - expected[i]).abs().max().item<double>() < 1e-5);
  }
}

} // namespace

TEST_CASE("C++ pipeline equals single-process training for every schedule") {
  run_on_ranks(2, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto reference = make_mlp();
    torch::manual_seed(1);
    const auto inputs = at::randn({20, 6});
    const auto target = at::randint(0, 3, {20});
    reference->zero_grad();
    const auto expected_loss = at::cross_entropy_loss(reference->forward(inputs), target);
    expected_loss.backward();

    const std::vector<std::pair<std::string, int>> cases{{"gpipe", 5}, {"1f1b", 5}, {"zero_bubble", 5},
                                                         {"interleaved", 4}};
    for (const auto& [schedule, microbatches] : cases) {
      auto model = make_mlp();
      const int virtual_stages = schedule == "interleaved" ? 2 : 1;
      pp::Pipeline pipe(pp::layers_from_sequential(*model), cross_entropy,
                        pp::PipelineOptions().process_group(pg).schedule(schedule).microbatches(microbatches)
                            .virtual_stages(virtual_stages));
      const auto loss = pipe.step(inputs, target);
      INFO(schedule << " on rank " << rank << " of " << world);
      CHECK(std::abs(loss.item<double>() - expected_loss.item<double>()) < 1e-5);
      check_gradients_match(pipe, reference);
    }
  });
}

TEST_CASE("C++ pipeline: a batch that does not split into the micro-batches is refused") {
  run_on_ranks(2, [](int, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = make_mlp();
    pp::Pipeline pipe(pp::layers_from_sequential(*model), cross_entropy,
                      pp::PipelineOptions().process_group(pg).microbatches(3));
    CHECK_THROWS_WITH(pipe.step(at::randn({10, 6}), at::randint(0, 3, {10})),
                      Contains("a batch of 10 samples") && Contains("does not split into 3 equal micro-batches"));
  });
}

TEST_CASE("C++ pipeline x data parallel: 2 replicas of 2 stages equal single-process training") {
  run_on_ranks(4, [](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> world) {
    // Replica r is ranks 2r, 2r+1; stage s of both replicas is ranks s, s+2.
    c10::intrusive_ptr<c10d::ProcessGroup> pipeline_group, data_parallel_group;
    for (int replica = 0; replica < 2; ++replica) {
      if (auto group = torchpar::new_group(world, {2 * replica, 2 * replica + 1})) {
        pipeline_group = group;
      }
    }
    for (int stage = 0; stage < 2; ++stage) {
      if (auto group = torchpar::new_group(world, {stage, stage + 2})) {
        data_parallel_group = group;
      }
    }
    REQUIRE(pipeline_group);
    REQUIRE(data_parallel_group);
    CHECK(pipeline_group->getRank() == rank % 2);
    CHECK(data_parallel_group->getRank() == rank / 2);

    auto reference = make_mlp();
    torch::manual_seed(1);
    const auto inputs = at::randn({16, 6});
    const auto target = at::randint(0, 3, {16});
    reference->zero_grad();
    at::cross_entropy_loss(reference->forward(inputs), target).backward();

    auto model = make_mlp();
    if (rank >= 2) {  // replica 1 starts elsewhere; the pipeline starts every replica from replica 0
      torch::NoGradGuard no_grad;
      for (auto& parameter : model->parameters()) {
        parameter.add_(1.0);
      }
    }
    pp::Pipeline pipe(pp::layers_from_sequential(*model), cross_entropy,
                      pp::PipelineOptions()
                          .process_group(pipeline_group)
                          .data_parallel_group(data_parallel_group)
                          .microbatches(2));
    const auto share = at::arange(8) + 8 * (rank / 2);
    pipe.step(inputs.index_select(0, share), target.index_select(0, share));
    CHECK(pipe.stages() == std::vector<int>{rank % 2});
    check_gradients_match(pipe, reference);
  });
}
