// plan/calibration_store: what --verify learned survives the file whole, per world and backend, the most recent
// samples kept, a stale or foreign file refused by name — in-process, in a temporary folder.
#include "catch_with_torch.h"

#include <torchpar/plan/calibration_store.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

namespace plan = torchpar::plan;
using Catch::Matchers::Contains;

namespace {

constexpr int64_t kMiB = 1 << 20;

// A two-layer pipeline sample whose every field the cost model reads is set to something other than its default.
plan::CalibrationSample sample(int microbatches, double measured_ms) {
  plan::CalibrationSample sample;
  sample.model.batch = 8;
  sample.model.contention = 1.7;
  sample.model.heap_retention_bytes = 3 * kMiB;
  for (int i = 0; i < 2; ++i) {
    plan::LayerProfile layer{"layer" + std::to_string(i), 2.0, 1.0, 1.5, kMiB, 800, 400};
    layer.input_bytes = 300;
    layer.forward_overhead_ms = 0.1;
    layer.in_features = 64;
    layer.out_features = 32;
    layer.elementwise = i == 1;
    layer.backward_temporary_bytes = 123;
    sample.model.layers.push_back(layer);
  }
  sample.network.all_reduce = {0.1, 1e-6};
  sample.network.send_recv = {0.05, 2e-6};
  sample.network.stage_transfer = plan::LinkCost{0.02, 2e-7};
  sample.network.ps_ring_bytes = 4096;
  sample.network.host_memory.stage_ring_bytes = 2 * kMiB;
  sample.setup.batch = 16;
  sample.setup.optimizer_state_factor = 2;
  sample.setup.optimizer_ms_per_byte = 1e-8;
  sample.configuration.strategy = plan::Strategy::Pipeline;
  sample.configuration.world = 2;
  sample.configuration.schedule = torchpar::pipeline::ScheduleKind::ZeroBubbleH1;
  sample.configuration.microbatches = microbatches;
  sample.configuration.balance = {1, 1};
  sample.measured_ms = measured_ms;
  return sample;
}

std::string temporary_folder() {
  char name[] = "/tmp/torchpar-calibration-XXXXXX";
  REQUIRE(mkdtemp(name) != nullptr);
  return name;
}

} // namespace

TEST_CASE("plan: a calibration store keeps every sample whole and refits the same calibration from the file") {
  const auto folder = temporary_folder();
  const auto path = folder + "/nested/calibration.pt";  // the folder is made
  plan::CalibrationStore store(path);
  CHECK_FALSE(store.calibration(2, "gloo").has_value());  // no file yet
  CHECK(store.samples(2, "gloo").empty());
  const std::vector<plan::CalibrationSample> samples{sample(1, 30), sample(2, 24), sample(4, 22)};
  const auto learned = store.learn(samples, 2, "gloo", plan::default_calibration(2));
  CHECK(learned.samples == 3);

  const plan::CalibrationStore reread(path);
  const auto restored = reread.samples(2, "gloo");
  REQUIRE(restored.size() == 3);
  for (size_t i = 0; i < samples.size(); ++i) {
    const auto& original = samples[i];
    const auto& copy = restored[i];
    CHECK(copy.configuration.describe() == original.configuration.describe());
    CHECK(copy.configuration.balance == original.configuration.balance);
    CHECK(copy.model.heap_retention_bytes == 3 * kMiB);
    CHECK(copy.model.layers[1].elementwise);
    CHECK(copy.model.layers[0].backward_temporary_bytes == 123);
    CHECK(copy.network.stage_transfer.has_value());
    CHECK_FALSE(copy.network.ddp_all_reduce.has_value());
    CHECK(copy.network.host_memory.stage_ring_bytes == 2 * kMiB);
    CHECK(copy.measured_ms == original.measured_ms);
    // Nothing the cost model reads was lost: the same prediction, time and memory.
    const auto before = plan::predict(original.model, original.network, original.setup, original.configuration);
    const auto after = plan::predict(copy.model, copy.network, copy.setup, copy.configuration);
    CHECK(after.step_ms == before.step_ms);
    CHECK(after.memory_per_rank == before.memory_per_rank);
  }
  const auto kept = reread.calibration(2, "gloo");
  REQUIRE(kept.has_value());
  CHECK(kept->compute_scale == learned.calibration.compute_scale);
  CHECK(kept->overlap == learned.calibration.overlap);
  // Kept per world and backend.
  CHECK_FALSE(reread.calibration(4, "gloo").has_value());
  CHECK_FALSE(reread.calibration(2, "shm").has_value());
  // No new samples: the kept ones refit to the same calibration.
  plan::CalibrationStore again(path);
  const auto refit = again.learn({}, 2, "gloo", plan::default_calibration(2));
  CHECK(refit.samples == 3);
  CHECK(refit.calibration.compute_scale == learned.calibration.compute_scale);
  CHECK(refit.calibration.per_action_ms == learned.calibration.per_action_ms);
  std::filesystem::remove_all(folder);
}

TEST_CASE("plan: a calibration store keeps the most recent samples, and refuses a file that is not one by name") {
  const auto folder = temporary_folder();
  plan::CalibrationStore store(folder + "/calibration.pt");
  std::vector<plan::CalibrationSample> samples;
  for (int i = 0; i < plan::CalibrationStore::kKeptSamples + 5; ++i) samples.push_back(sample(2, 20 + i));
  CHECK(store.learn(samples, 2, "gloo", {}).samples == plan::CalibrationStore::kKeptSamples);
  const auto kept = store.samples(2, "gloo");
  REQUIRE(kept.size() == plan::CalibrationStore::kKeptSamples);
  CHECK(kept.front().measured_ms == 25);  // the five oldest dropped
  CHECK(kept.back().measured_ms == 20 + plan::CalibrationStore::kKeptSamples + 4);

  const auto stale = folder + "/old.json";
  std::ofstream(stale) << "{}";
  plan::CalibrationStore foreign(stale);
  CHECK_THROWS_WITH(foreign.calibration(2, "gloo"), Contains("old.json is not one") && Contains("remove it"));
  CHECK_THROWS_WITH(foreign.learn(samples, 2, "gloo", {}), Contains("old.json is not one"));
  CHECK(std::ifstream(stale).get() == '{');  // left as it was
  std::filesystem::remove_all(folder);
}

TEST_CASE("plan: the default calibration overlaps communication only where ranks have cores to spare") {
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  CHECK(plan::default_calibration(1).overlap == Approx(std::min(1.0, cores - 1)));
  CHECK(plan::default_calibration(static_cast<int>(cores)).overlap == 0);
  CHECK(plan::default_calibration(1).compute_scale == 1);
  CHECK_THROWS_WITH(plan::default_calibration(0), Contains("a world of 0"));
  CHECK_THAT(plan::calibration_key(4, "shm"), Contains("/shm/4 ranks/") && Contains("threads/v3"));
  CHECK_THAT(plan::describe(plan::Calibration()), Contains("compute x 1.00") && Contains("100% of communication"));
}
