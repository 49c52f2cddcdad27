// torchpar::pipeline from C++: schedules through the simulator, the exact partitioner, then the
// runtime on forked ranks against single-process training of the same batch.
#include <algorithm>
#include <cmath>
#include <functional>

#include "catch_with_torch.h"
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <torchpar/comm/process_group.h>
#include <torchpar/pipeline/microbatches.h>
#include <torchpar/pipeline/partition.h>
#include <torchpar/pipeline/pipeline.h>
#include <torchpar/pipeline/simulator.h>

#include "harness.h"

namespace pp = torchpar::pipeline;
using torchpar::testing::run_on_ranks;
using Catch::Matchers::Contains;

namespace {

pp::ScheduleSpec spec(pp::ScheduleKind kind, int ranks, int microbatches, int virtual_stages = 1) {
  pp::ScheduleSpec result;
  result.kind = kind;
  result.ranks = ranks;
  result.microbatches = microbatches;
  result.virtual_stages = virtual_stages;
  return result;
}

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

TEST_CASE("schedule names: each parses back to its schedule, aliases too, and an unknown one lists them") {
  CHECK(pp::schedule_names() == std::vector<std::string>{"gpipe", "1f1b", "interleaved", "zero_bubble"});
  for (const auto& name : pp::schedule_names()) {
    CHECK(pp::schedule_name(pp::parse_schedule(name)) == name);
  }
  CHECK(pp::parse_schedule("Interleaved-1F1B") == pp::ScheduleKind::Interleaved1F1B);
  CHECK(pp::parse_schedule("ZB-H1") == pp::ScheduleKind::ZeroBubbleH1);
  CHECK(pp::parse_schedule("one_f_one_b") == pp::ScheduleKind::OneFOneB);
  CHECK_THROWS_WITH(pp::parse_schedule("round_robin"),
                    Contains("unknown pipeline schedule 'round_robin' (gpipe, 1f1b, interleaved, zero_bubble)"));
}

TEST_CASE("stage costs by name: named fields set, the others keep their defaults, unknown names refused") {
  const auto costs = pp::parse_stage_costs({{{"forward", 3.0}, {"transfer", 0.5}},
                                            {},
                                            {{"backward", 5.0}, {"backward_input", 2.0}, {"backward_weight", 4.0}}});
  REQUIRE(costs.size() == 3);
  CHECK(costs[0].forward == 3.0);
  CHECK(costs[0].transfer == 0.5);
  CHECK(costs[0].backward == pp::ActionCosts{}.backward);
  CHECK(costs[1].forward == pp::ActionCosts{}.forward);
  CHECK(costs[1].backward_weight == pp::ActionCosts{}.backward_weight);
  CHECK(costs[2].forward == pp::ActionCosts{}.forward);
  CHECK(costs[2].backward == 5.0);
  CHECK(costs[2].backward_input == 2.0);
  CHECK(costs[2].backward_weight == 4.0);
  CHECK(pp::parse_stage_costs({}).empty());
  CHECK_THROWS_WITH(pp::parse_stage_costs({{}, {{"forwards", 1.0}}}),
                    Contains("simulate_stages: unknown cost 'forwards' (forward, backward, backward_input, "
                             "backward_weight, transfer)"));
}

TEST_CASE("every schedule is complete and deadlock-free, and 1F1B's bubble is (p-1)/(m+p-1)") {
  for (int ranks = 1; ranks <= 6; ++ranks) {
    for (int m = 1; m <= 12; ++m) {
      for (auto kind : {pp::ScheduleKind::GPipe, pp::ScheduleKind::OneFOneB, pp::ScheduleKind::ZeroBubbleH1}) {
        const auto simulation = pp::simulate(spec(kind, ranks, m));
        if (kind != pp::ScheduleKind::ZeroBubbleH1) {
          CHECK(std::abs(simulation.bubble_fraction - double(ranks - 1) / (m + ranks - 1)) < 1e-9);
        }
      }
      if (m % ranks == 0) {
        const auto interleaved = pp::simulate(spec(pp::ScheduleKind::Interleaved1F1B, ranks, m, 2));
        CHECK(std::abs(interleaved.bubble_fraction - double(ranks - 1) / (2 * m + ranks - 1)) < 1e-9);
      }
    }
  }
}

TEST_CASE("the simulator names the rank and action of a deadlock") {
  auto lists = pp::all_rank_actions(spec(pp::ScheduleKind::OneFOneB, 2, 2));
  // Rank 1 waits for its second forward's input before running the backward that lets rank 0 go on:
  // fine. Moving the receive after the forward that needs it is not.
  auto& rank1 = lists[1];
  const auto recv = std::find(rank1.begin(), rank1.end(), pp::Action{pp::ActionType::RecvActivation, 1, 0});
  REQUIRE(recv != rank1.end());
  std::rotate(recv, recv + 1, recv + 2);
  REQUIRE_THROWS_WITH(pp::simulate(lists, 2, 2), Contains("deadlocks") && Contains("rank 1 waits at F0@s1"));
}

TEST_CASE("the balancer finds the contiguous partition with the smallest slowest stage") {
  const std::vector<double> costs{1, 1, 1, 10, 1, 1, 1};
  CHECK(pp::balanced_partition(costs, 3) == std::vector<int64_t>{3, 1, 3});
  CHECK(pp::uniform_partition(7, 3) == std::vector<int64_t>{3, 2, 2});
  CHECK_THROWS_WITH(pp::uniform_partition(2, 3), Contains("2 layers cannot fill 3 stages"));
}

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
