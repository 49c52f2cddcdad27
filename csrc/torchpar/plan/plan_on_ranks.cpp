#include <torchpar/plan/plan_on_ranks.h>

#include <torchpar/plan/host_overheads.h>
#include <torchpar/plan/profile.h>

#include <torchpar/common/cpu_allocations.h>
#include <torchpar/common/error_message.h>

#include <ATen/ops/tensor.h>
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

// What rank 0 alone did before a collective (read or write the calibration store) must not leave the others waiting
// in it when it failed: every rank learns whether it did, and all throw (rank 0 with its message); else every rank
// gets rank 0's `rank0_value`.
int64_t agree_with_rank0(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const std::string& rank0_error,
                         int64_t rank0_value, const char* what) {
  std::vector<at::Tensor> outcome{at::tensor({rank0_error.empty() ? int64_t{0} : int64_t{1}, rank0_value}, at::kLong)};
  group->broadcast(outcome)->wait();
  const auto* told = outcome.front().data_ptr<int64_t>();
  TORCH_CHECK(told[0] == 0, what, ": ",
              group->getRank() == 0 ? rank0_error : std::string("rank 0 failed (its error says why)"));
  return told[1];
}

} // namespace

PlannedOnRanks plan_on_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                             const std::vector<pipeline::LayerFactory>& factories, const pipeline::Tensors& sample,
                             PlanOptions options, TrainingSetup setup, const CalibrationStore& store) {
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
  planned.setup = setup;
  planned.options = options;
  // What earlier --verify runs on this machine taught, else the default with the engines' host time measured on
  // these ranks (collective: every rank learns which from rank 0).
  std::optional<Calibration> learned;
  std::string store_error;
  if (rank == 0) {
    try {
      learned = store.calibration(group->getSize(), group->getBackendName());
    } catch (const std::exception& error) {
      store_error = message_of(error);
    }
  }
  planned.calibration_learned = agree_with_rank0(group, store_error, learned ? 1 : 0, "plan_on_ranks") == 1;
  if (!planned.calibration_learned) {
    planned.calibration = default_calibration(group->getSize());
    planned.probes = measure_host_overheads(group, network, planned.calibration);
  }
  at::Tensor chosen = encode(nullptr, factories.size());
  std::string reasons;
  if (rank == 0) {
    model = model.scaled_to(passes.alone_ms);
    model.contention = passes.together_ms / passes.alone_ms;
    planned.model = model;
    planned.network = network;
    if (learned) planned.calibration = *learned;
    planned.plan = Planner(model, network, setup, planned.calibration).plan(options);
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

VerifiedPlan verify_plan_on_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                  const std::vector<pipeline::LayerFactory>& factories, const TrainingRun& run,
                                  const PlannedOnRanks& planned, int top, CalibrationStore store, int steps) {
  TORCH_CHECK(group, "verify_plan_on_ranks: no process group");
  const int rank = group->getRank();
  const int world = group->getSize();
  VerifiedPlan result;
  std::vector<CalibrationSample> samples;
  size_t next = 0;  // rank 0's place in its ranking
  for (int verified = 0; verified < top; ++verified) {
    const Prediction* prediction = nullptr;
    Configuration configuration;
    if (rank == 0) {
      for (; next < planned.plan.ranked.size() && prediction == nullptr; ++next) {
        configuration = planned.plan.ranked[next].configuration;
        configuration.balance = planned.plan.ranked[next].balance;
        if (verifiable_on_ranks(configuration)) prediction = &planned.plan.ranked[next];
      }
    }
    std::vector<at::Tensor> broadcast{encode(prediction ? &configuration : nullptr, factories.size())};
    group->broadcast(broadcast)->wait();
    if (broadcast.front().data_ptr<int64_t>()[0] == 0) break;  // no more that C++ builds
    configuration = decode(broadcast.front());
    VerifiedConfiguration entry{configuration, 0, 0, {}};
    if (prediction != nullptr) {
      entry.predicted_ms = prediction->step_ms;
      entry.predicted_tensor_bytes = prediction->tensor_memory_per_rank;
    }
    entry.measured = verify_on_ranks(group, factories, run, configuration, planned.setup, /*warmup=*/2, steps);
    if (rank == 0) {
      samples.push_back({planned.model, planned.network, planned.setup, configuration, entry.measured.step_ms});
    }
    result.verified.push_back(std::move(entry));
  }
  // The fit starts from the default calibration with the engines' host time measured on these ranks, as
  // `python -m torchpar.plan --verify` starts it (both keep their samples in the same store): the plan's own when it
  // had no learned one, else measured now (collective), and those probes are samples too.
  Calibration start = planned.calibration;
  auto probes = planned.probes;
  if (planned.calibration_learned) {
    start = default_calibration(world);
    probes = measure_host_overheads(group, planned.network, start);
  }
  result.replanned = planned;
  at::Tensor chosen = encode(nullptr, factories.size());
  std::string store_error;
  if (rank == 0 && !samples.empty()) {
    samples.insert(samples.begin(), probes.begin(), probes.end());
    try {
      const auto learned = store.learn(samples, world, group->getBackendName(), start);
      result.calibration_samples = learned.samples;
      result.replanned.calibration = learned.calibration;
      result.replanned.calibration_learned = true;
      result.replanned.plan =
          Planner(planned.model, planned.network, planned.setup, learned.calibration).plan(planned.options);
    } catch (const std::exception& error) {
      store_error = message_of(error);
    }
  }
  agree_with_rank0(group, store_error, 0, "verify_plan_on_ranks");
  if (rank == 0) {
    if (!result.replanned.plan.ranked.empty()) {
      Configuration best = result.replanned.plan.ranked.front().configuration;
      best.balance = result.replanned.plan.ranked.front().balance;
      chosen = encode(&best, factories.size());
    }
  }
  std::vector<at::Tensor> broadcast{chosen};
  group->broadcast(broadcast)->wait();
  TORCH_CHECK(chosen.data_ptr<int64_t>()[0] == 1, "verify_plan_on_ranks: no configuration of ", world,
              " ranks fits once calibrated",
              rank == 0 ? ":\n" + render_table(result.replanned.plan) : " (rank 0 says why)");
  result.replanned.chosen = decode(chosen);
  return result;
}

} // namespace torchpar::plan
