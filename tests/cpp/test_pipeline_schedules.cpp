// pipeline/schedules, simulator and partition: the schedules as action lists, their names, the
// simulator's checks and costs, and the balancer (pure, in-process).
#include <algorithm>
#include <cmath>

#include "catch_with_torch.h"

#include <torchpar/pipeline/partition.h>
#include <torchpar/pipeline/schedules.h>
#include <torchpar/pipeline/simulator.h>

namespace pp = torchpar::pipeline;
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

} // namespace

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
