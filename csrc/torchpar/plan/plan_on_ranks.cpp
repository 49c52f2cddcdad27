#include <torchpar/plan/plan_on_ranks.h>

#include <torchpar/plan/profile.h>

#include <torchpar/common/cpu_allocations.h>

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>


namespace torchpar::plan {
namespace {

// A configuration as integers (a tensor rank 0 broadcasts): found, then its fields, then its cut.
constexpr int64_t kFields = 11;

at::Tensor encode(const Configuration* configuration, size_t layers) {
  auto encoded = at::zeros({kFields + static_cast<int64_t>(layers)}, at::kLong);
  if (configuration == nullptr) return encoded;
  auto* field = encoded.data_ptr<int64_t>();
  const auto& c = *configuration;
  const int64_t values[kFields] = {1,
                                   static_cast<int64_t>(c.strategy),
                                   c.world,
                                   c.replicas,
                                   c.tensor,
                                   static_cast<int64_t>(c.schedule),
                                   c.microbatches,
                                   c.virtual_stages,
                                   c.servers,
                                   c.synchronous ? 1 : 0,
                                   c.zero_stage};
  std::copy(std::begin(values), std::end(values), field);
  TORCH_CHECK(c.balance.size() <= layers, "plan_on_ranks: a cut of ", c.balance.size(), " stages for ", layers,
              " layers");
  std::copy(c.balance.begin(), c.balance.end(), field + kFields);
  return encoded;
}

Configuration decode(const at::Tensor& encoded) {
  const auto* field = encoded.data_ptr<int64_t>();
  Configuration c;
  c.strategy = static_cast<Strategy>(field[1]);
  c.world = static_cast<int>(field[2]);
  c.replicas = static_cast<int>(field[3]);
  c.tensor = static_cast<int>(field[4]);
  c.schedule = static_cast<pipeline::ScheduleKind>(field[5]);
  c.microbatches = static_cast<int>(field[6]);
  c.virtual_stages = static_cast<int>(field[7]);
  c.servers = static_cast<int>(field[8]);
  c.synchronous = field[9] != 0;
  c.zero_stage = static_cast<int>(field[10]);
  for (int64_t i = kFields; i < encoded.numel() && field[i] > 0; ++i) c.balance.push_back(field[i]);
  return c;
}

} // namespace

PlannedOnRanks plan_on_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                             const std::vector<pipeline::LayerFactory>& factories, const pipeline::Tensors& sample,
                             PlanOptions options, TrainingSetup setup) {
  TORCH_CHECK(group, "plan_on_ranks: no process group");
  const int rank = group->getRank();
  options.world(group->getSize());
  ModelProfile model;
  if (rank == 0) model = profile_layers(factories, sample, /*repeats=*/5, &setup);
  group->barrier()->wait();  // the others wait: the profile times one rank alone
  const auto passes = measure_model_pass(factories, sample, group);
  auto network = measure_network(group);
  // As the process was launched: glibc keeps freed blocks only where the launch fixed its thresholds.
  network.host_memory.keeps_freed_memory = keeping_freed_memory();
  PlannedOnRanks planned;
  at::Tensor chosen = encode(nullptr, factories.size());
  std::string reasons;
  if (rank == 0) {
    model = model.scaled_to(passes.alone_ms);
    model.contention = passes.together_ms / passes.alone_ms;
    planned.plan = Planner(model, network, setup).plan(options);
    if (!planned.plan.ranked.empty()) {
      Configuration best = planned.plan.ranked.front().configuration;
      best.balance = planned.plan.ranked.front().balance;
      chosen = encode(&best, factories.size());
    } else {
      reasons = render_table(planned.plan);
    }
  }
  std::vector<at::Tensor> broadcast{chosen};
  group->broadcast(broadcast)->wait();
  TORCH_CHECK(chosen.data_ptr<int64_t>()[0] == 1, "plan_on_ranks: no configuration of ", group->getSize(),
              " ranks fits", rank == 0 ? ":\n" + reasons : " (rank 0 says why)");
  planned.chosen = decode(chosen);
  return planned;
}

} // namespace torchpar::plan
