// The parameter server's consistency rules in-process, against a reference written from their
// definitions: every interleaving of a few workers' pushes (BSP rounds, SSP's staleness bound, ASP),
// workers finishing or lost midway, the timeouts that drop a worker holding the others up, and the
// clocks a job resumes from after a checkpoint. No processes, no sockets: milliseconds.
#include "catch_with_torch.h"
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <torchpar/ps/checkpoint_file.h>
#include <torchpar/ps/consistency.h>
#include <torchpar/ps/dense_table.h>
#include <torchpar/ps/server_checkpoint.h>

#include <algorithm>
#include <filesystem>
#include <random>

namespace ps = torchpar::ps;
using Catch::Matchers::Contains;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

constexpr milliseconds kTimeout{1000};

// Distinct per worker and clock, so a round that averaged the wrong gradients shows in the values.
double gradient(int worker, int64_t clock) {
  return (worker + 1) * 16.0 + static_cast<double>(clock) + 1.0;
}

std::unique_ptr<ps::DenseTable> make_table(const std::string& name, int num_workers) {
  // SGD with lr 1 and no momentum: the value is minus the sum of the gradients applied.
  return std::make_unique<ps::DenseTable>(name, std::vector<int64_t>{1}, 0, 1, at::zeros({1}, at::kDouble),
                                          ps::OptimizerConfig::sgd(1.0), num_workers);
}

double value_of(const ps::Table& table) {
  return static_cast<const ps::DenseTable&>(table).values().item<double>();
}

// A server's rules with its tables, driven the way the server drives them: a push, then the rounds
// it completed; a worker leaving, then the rounds it no longer holds back.
struct Job {
  ps::ConsistencyEngine engine;
  ps::Tables tables;
  Clock::time_point now = Clock::now();
  std::vector<int64_t> rounds_applied; // the clock of each round applied, in order

  Job(ps::Consistency model, int staleness, int num_workers, int num_tables = 1)
      : engine(model, staleness, kTimeout, num_workers, now) {
    for (int t = 0; t < num_tables; ++t) {
      tables.push_back(make_table("t" + std::to_string(t), num_workers));
    }
  }
  void push(int worker, int table = 0) {
    const int64_t clock = tables[table]->pushes[worker];
    engine.contribute(worker, *tables[table], at::Tensor(), at::full({1}, gradient(worker, clock), at::kDouble), now);
    settle();
  }
  void finish(int worker) {
    engine.finish(worker);
    settle();
  }
  void lose(int worker) {
    engine.lose(worker);
    settle();
  }
  void settle() {
    if (engine.model() == ps::Consistency::BSP) {
      engine.apply_full_rounds(tables, [&](ps::Table& table) { rounds_applied.push_back(table.applied - 1); });
    }
  }
};

// The rules as the design states them, with plain integers.
struct Reference {
  ps::Consistency model;
  int staleness;
  std::vector<int64_t> pushes;
  std::vector<bool> active;
  int64_t applied = 0; // BSP rounds
  double value = 0.0;

  Reference(ps::Consistency model, int staleness, int num_workers)
      : model(model), staleness(staleness), pushes(num_workers, 0), active(num_workers, true) {}

  void push(int worker) {
    if (model != ps::Consistency::BSP) value -= gradient(worker, pushes[worker]);
    pushes[worker] += 1;
    settle();
  }
  void leave(int worker) {
    active[worker] = false;
    settle();
  }
  // BSP: a round is applied once it exists and every active worker pushed to it; its update is the
  // mean of the gradients pushed to it.
  void settle() {
    if (model != ps::Consistency::BSP) return;
    for (;;) {
      bool exists = false;
      bool full = true;
      for (size_t w = 0; w < pushes.size(); ++w) {
        exists = exists || pushes[w] > applied;
        full = full && (!active[w] || pushes[w] > applied);
      }
      if (!exists || !full) return;
      double sum = 0.0;
      int count = 0;
      for (size_t w = 0; w < pushes.size(); ++w) {
        if (pushes[w] > applied) {
          sum += gradient(static_cast<int>(w), applied);
          count += 1;
        }
      }
      value -= sum / count;
      applied += 1;
    }
  }
  bool readable(int64_t clock) const {
    switch (model) {
      case ps::Consistency::ASP: return true;
      case ps::Consistency::BSP: return applied >= clock;
      case ps::Consistency::SSP: {
        int64_t slowest = std::numeric_limits<int64_t>::max();
        for (size_t w = 0; w < pushes.size(); ++w) {
          if (active[w]) slowest = std::min(slowest, pushes[w]);
        }
        return clock - slowest <= staleness;
      }
    }
    return false;
  }
};

struct Model {
  ps::Consistency consistency;
  int staleness;
};
const std::vector<Model> kModels = {{ps::Consistency::BSP, 0}, {ps::Consistency::SSP, 0}, {ps::Consistency::SSP, 1},
                                    {ps::Consistency::SSP, 2}, {ps::Consistency::ASP, 0}};

std::string describe(const Model& model, const std::vector<int>& events) {
  std::string text = std::string(ps::consistency_name(model.consistency)) + " s=" + std::to_string(model.staleness) +
                     ", events";
  for (int e : events) text += " " + std::to_string(e);
  return text;
}

// After each event every active worker's next read (a pull at its clock, a push_pull's after its
// push) is answered exactly when the reference says so, and the values match the reference's.
void check_against_reference(const Job& job, const Reference& reference) {
  const auto& table = *job.tables[0];
  for (int w = 0; w < job.engine.num_workers(); ++w) {
    REQUIRE(table.pushes[w] == reference.pushes[w]);
    if (job.engine.state(w) != ps::WorkerState::Active) continue;
    REQUIRE(job.engine.ready(table, table.pushes[w]) == reference.readable(reference.pushes[w]));
    REQUIRE(job.engine.ready(table, table.pushes[w] + 1) == reference.readable(reference.pushes[w] + 1));
  }
  REQUIRE(table.applied == reference.applied);
  REQUIRE(value_of(table) == Approx(reference.value));
}

// `events`: a worker's id pushes its next clock; kFinish + w finishes worker w, kLose + w loses it.
constexpr int kFinish = 100;
constexpr int kLose = 200;

void replay(const Model& model, int num_workers, const std::vector<int>& events) {
  INFO(describe(model, events));
  Job job(model.consistency, model.staleness, num_workers);
  Reference reference(model.consistency, model.staleness, num_workers);
  check_against_reference(job, reference);
  for (int event : events) {
    if (event >= kLose) {
      job.lose(event - kLose);
      reference.leave(event - kLose);
    } else if (event >= kFinish) {
      job.finish(event - kFinish);
      reference.leave(event - kFinish);
    } else {
      job.push(event);
      reference.push(event);
    }
    check_against_reference(job, reference);
  }
  // Rounds are applied once each, in clock order.
  for (size_t i = 0; i < job.rounds_applied.size(); ++i) {
    REQUIRE(job.rounds_applied[i] == static_cast<int64_t>(i));
  }
}

// Every order of `pushes_each` pushes by each of `num_workers` workers.
void replay_every_interleaving(int num_workers, int pushes_each) {
  std::vector<int> events;
  for (int w = 0; w < num_workers; ++w) events.insert(events.end(), pushes_each, w);
  for (const auto& model : kModels) {
    auto order = events;
    int orders = 0;
    do {
      replay(model, num_workers, order);
      ++orders;
    } while (std::next_permutation(order.begin(), order.end()));
    CHECK(orders > 1);
  }
}

ps::Request pull(ps::MessageKind kind, int64_t clock) {
  ps::Request request;
  request.kind = kind;
  if (kind == ps::MessageKind::PullRows || kind == ps::MessageKind::PushRows) {
    request.rows.push_back(ps::RowsItem{0, clock});
  } else {
    request.dense.push_back(ps::DenseItem{0, clock});
  }
  return request;
}

struct TemporaryDirectory {
  std::filesystem::path path;
  TemporaryDirectory() {
    char name[] = "/tmp/torchpar-ps-consistency-XXXXXX";
    REQUIRE(mkdtemp(name) != nullptr);
    path = name;
  }
  ~TemporaryDirectory() { std::filesystem::remove_all(path); }
};

ps::ServerCheckpoint checkpoint_in(const TemporaryDirectory& directory, int64_t every, int num_workers,
                                   ps::Consistency consistency, std::vector<std::string>* log = nullptr) {
  return ps::ServerCheckpoint(directory.path.string(), every, 0, 1, num_workers, consistency,
                              [log](const std::string& line) {
                                if (log) log->push_back(line);
                              });
}

} // namespace

TEST_CASE("consistency: every interleaving of two workers' pushes reads and applies as the reference does") {
  replay_every_interleaving(2, 4);
}

TEST_CASE("consistency: every interleaving of three workers' pushes reads and applies as the reference does") {
  replay_every_interleaving(3, 2);
}

TEST_CASE("consistency: random interleavings with workers finishing or lost midway match the reference") {
  std::mt19937 random(20261201);
  for (int trial = 0; trial < 300; ++trial) {
    const int num_workers = 2 + static_cast<int>(random() % 2);
    const auto& model = kModels[random() % kModels.size()];
    std::vector<int> events;
    std::vector<bool> active(num_workers, true);
    for (int step = 0; step < 14; ++step) {
      const int w = static_cast<int>(random() % num_workers);
      if (!active[w]) continue; // a worker that left sends nothing more
      const auto draw = random() % 10;
      if (draw == 0) {
        events.push_back(kFinish + w);
        active[w] = false;
      } else if (draw == 1) {
        events.push_back(kLose + w);
        active[w] = false;
      } else {
        events.push_back(w);
      }
    }
    replay(model, num_workers, events);
  }
}

TEST_CASE("consistency: a push_pull reads after its own push, a pull at its clock") {
  Job job(ps::Consistency::BSP, 0, 2);
  job.push(0);
  job.push(1);
  // Both at clock 1, round 0 applied.
  CHECK(job.engine.readable(pull(ps::MessageKind::Pull, 1), job.tables));
  CHECK(job.engine.readable(pull(ps::MessageKind::PullRows, 1), job.tables));
  CHECK_FALSE(job.engine.readable(pull(ps::MessageKind::PushPull, 1), job.tables)); // waits for round 1
  job.push(0);
  CHECK_FALSE(job.engine.readable(pull(ps::MessageKind::PushPull, 1), job.tables));
  job.push(1);
  CHECK(job.engine.readable(pull(ps::MessageKind::PushPull, 1), job.tables));

  Job ssp(ps::Consistency::SSP, 1, 2);
  ssp.push(0);
  CHECK(ssp.engine.readable(pull(ps::MessageKind::PushPull, 0), ssp.tables)); // clock 1, slowest 0
  ssp.push(0);
  CHECK_FALSE(ssp.engine.readable(pull(ps::MessageKind::PushPull, 1), ssp.tables)); // clock 2, slowest 0
  CHECK(ssp.engine.readable(pull(ps::MessageKind::Pull, 1), ssp.tables));
}

TEST_CASE("consistency: a BSP round waits for every active worker, then averages what was pushed to it") {
  Job job(ps::Consistency::BSP, 0, 3);
  job.push(0);
  job.push(1);
  CHECK(job.tables[0]->applied == 0);
  CHECK(value_of(*job.tables[0]) == 0.0);
  job.finish(2); // the round no longer waits for worker 2, which pushed nothing to it
  CHECK(job.tables[0]->applied == 1);
  CHECK(value_of(*job.tables[0]) == Approx(-(gradient(0, 0) + gradient(1, 0)) / 2));
  job.push(0);
  job.push(1);
  job.push(1); // ahead: round 2 opens with worker 1 alone
  job.lose(0);
  // Round 1 had both; round 2 is worker 1's alone once worker 0 is gone.
  CHECK(job.tables[0]->applied == 3);
  CHECK(value_of(*job.tables[0]) == Approx(-(gradient(0, 0) + gradient(1, 0)) / 2 -
                                           (gradient(0, 1) + gradient(1, 1)) / 2 - gradient(1, 2)));
  CHECK(job.rounds_applied == std::vector<int64_t>{0, 1, 2});
  CHECK(job.tables[0]->rounds.empty());
}

TEST_CASE("consistency: each table's rounds go on without waiting for another table's") {
  Job job(ps::Consistency::BSP, 0, 2, 2);
  job.push(0, 0);
  job.push(0, 1);
  job.push(1, 1); // table 1's round 0 is full; table 0's still waits for worker 1
  CHECK(job.tables[0]->applied == 0);
  CHECK(job.tables[1]->applied == 1);
}

TEST_CASE("consistency: finished and lost workers no longer count, and leave once") {
  ps::ConsistencyEngine engine(ps::Consistency::SSP, 1, kTimeout, 3, Clock::now());
  CHECK(engine.active_count() == 3);
  CHECK_FALSE(engine.any_finished());
  engine.finish(0);
  CHECK(engine.any_finished());
  CHECK_FALSE(engine.lose(0)); // finished stays finished
  CHECK(engine.state(0) == ps::WorkerState::Finished);
  CHECK(engine.lose(1));
  CHECK_FALSE(engine.lose(1));
  CHECK(engine.state(1) == ps::WorkerState::Lost);
  CHECK(engine.active_count() == 1);
  CHECK(engine.any_active());
  engine.finish(2);
  CHECK_FALSE(engine.any_active());
}

TEST_CASE("consistency: the slowest clock is the active workers', and read-only tables do not hold it back") {
  Job job(ps::Consistency::SSP, 3, 2, 2);
  CHECK_FALSE(job.engine.common_clock(job.tables)); // nobody pushed
  job.push(0);
  job.push(0);
  job.push(1);
  CHECK(job.engine.slowest_clock(*job.tables[0]) == 1);
  CHECK(job.engine.slowest_clock(*job.tables[1]) == 0);
  CHECK(job.engine.common_clock(job.tables) == std::optional<int64_t>(1)); // table 1 is read-only
  job.finish(1);
  CHECK(job.engine.slowest_clock(*job.tables[0]) == 2);
  CHECK(job.engine.common_clock(job.tables) == std::optional<int64_t>(2));
  job.finish(0);
  CHECK(job.engine.slowest_clock(*job.tables[0]) == std::numeric_limits<int64_t>::max());
  CHECK_FALSE(job.engine.common_clock(job.tables));
}

TEST_CASE("consistency: BSP drops the workers missing from a round open for the timeout") {
  Job job(ps::Consistency::BSP, 0, 3, 2);
  const auto opened = job.now;
  job.push(0, 1);
  job.finish(2);
  CHECK(job.engine.late_workers(job.tables, {}, opened + kTimeout - milliseconds(1)).empty());
  const auto drops = job.engine.late_workers(job.tables, {}, opened + kTimeout);
  REQUIRE(drops.size() == 1); // worker 2 finished: only worker 1 holds the round up
  CHECK(drops[0].worker == 1);
  CHECK(drops[0].reason == "it did not push clock 0 of table 't1' within the timeout (1000 ms)");

  // A round is timed from its first push, and only the oldest open round counts.
  job.now = opened + kTimeout;
  job.push(1, 1);
  job.push(1, 1);
  CHECK(job.tables[1]->applied == 1);
  CHECK(job.engine.late_workers(job.tables, {}, job.now + kTimeout - milliseconds(1)).empty());
  CHECK(job.engine.late_workers(job.tables, {}, job.now + kTimeout).at(0).worker == 0);
}

TEST_CASE("consistency: without rounds a silent worker is dropped only when the others wait for it") {
  for (auto model : {ps::Consistency::ASP, ps::Consistency::SSP}) {
    INFO(ps::consistency_name(model));
    Job job(model, 0, 3);
    const auto start = job.now;
    const auto late = start + kTimeout;
    // Silent, but nobody waits: merely idle.
    CHECK(job.engine.late_workers(job.tables, {}, late + kTimeout).empty());
    // A read waiting shorter than the timeout does not yet make anyone late.
    CHECK(job.engine.late_workers(job.tables, {{0, late}}, late + milliseconds(999)).empty());
    // Worker 0's read waited the timeout: the silent workers are dropped, not worker 0 (its read waits).
    job.engine.heard_from(2, start + milliseconds(500));
    auto drops = job.engine.late_workers(job.tables, {{0, start}}, late);
    REQUIRE(drops.size() == 1); // worker 2 spoke 500 ms ago
    CHECK(drops[0].worker == 1);
    CHECK(drops[0].reason ==
          "it sent nothing for longer than the timeout (1000 ms) while other workers' reads waited for it");
    drops = job.engine.late_workers(job.tables, {{0, start}}, late + milliseconds(500));
    REQUIRE(drops.size() == 2);
    CHECK(drops[1].worker == 2);
    // Finished and lost workers are not dropped again.
    job.finish(1);
    job.lose(2);
    CHECK(job.engine.late_workers(job.tables, {{0, start}}, late + kTimeout).empty());
  }
}

TEST_CASE("consistency: without rounds the only active worker is dropped after the timeout of silence") {
  for (auto model : {ps::Consistency::ASP, ps::Consistency::SSP}) {
    INFO(ps::consistency_name(model));
    Job job(model, 0, 2);
    job.finish(0); // the service's end waits for worker 1 alone
    job.engine.heard_from(1, job.now);
    CHECK(job.engine.late_workers(job.tables, {}, job.now + kTimeout - milliseconds(1)).empty());
    const auto drops = job.engine.late_workers(job.tables, {}, job.now + kTimeout);
    REQUIRE(drops.size() == 1);
    CHECK(drops[0].worker == 1);
    CHECK(drops[0].reason == "it sent nothing for longer than the timeout (1000 ms)");
    // A worker whose own read waits is quiet, not silent.
    CHECK(job.engine.late_workers(job.tables, {{1, job.now}}, job.now + 2 * kTimeout).empty());
  }
}

TEST_CASE("consistency: a restored table resumes BSP from its slowest worker's clock, SSP and ASP as saved") {
  auto saved = make_table("w", 3);
  saved->pushes = {5, 3, 4};
  const auto state = saved->snapshot(); // an SSP job's clocks

  for (auto model : {ps::Consistency::SSP, ps::Consistency::ASP}) {
    Job job(model, 1, 3);
    job.tables[0]->restore(state);
    job.engine.resume_restored(*job.tables[0]);
    CHECK(job.tables[0]->pushes == std::vector<int64_t>{5, 3, 4});
    CHECK(job.engine.ready(*job.tables[0], 5) == (model == ps::Consistency::ASP)); // 5 - 3 > 1 under SSP
    job.push(2); // not the slowest
    CHECK(job.engine.ready(*job.tables[0], 5) == (model == ps::Consistency::ASP));
    job.push(1); // the slowest at 4: worker 0's read at clock 5 is within the bound
    CHECK(job.engine.ready(*job.tables[0], 5));
  }

  Job bsp(ps::Consistency::BSP, 0, 3);
  bsp.tables[0]->restore(state);
  bsp.engine.resume_restored(*bsp.tables[0]);
  CHECK(bsp.tables[0]->pushes == std::vector<int64_t>{3, 3, 3});
  CHECK(bsp.tables[0]->applied == 3);
  CHECK(bsp.engine.ready(*bsp.tables[0], 3));
  bsp.push(0);
  bsp.push(1);
  CHECK_FALSE(bsp.engine.ready(*bsp.tables[0], 4));
  bsp.push(2);
  CHECK(bsp.engine.ready(*bsp.tables[0], 4));
  CHECK(bsp.rounds_applied == std::vector<int64_t>{3});

  // A BSP checkpoint's rounds applied win over a lost worker's lower clock.
  saved->pushes = {6, 2, 6};
  saved->applied = 6;
  Job after_loss(ps::Consistency::BSP, 0, 3);
  after_loss.tables[0]->restore(saved->snapshot());
  after_loss.engine.resume_restored(*after_loss.tables[0]);
  CHECK(after_loss.tables[0]->pushes == std::vector<int64_t>{6, 6, 6});
  CHECK(after_loss.tables[0]->applied == 6);
}

TEST_CASE("server checkpoint: BSP writes each periodic round once every table applied it, at that round's clocks") {
  TemporaryDirectory directory;
  const auto path = ps::checkpoint_path(directory.path.string(), 0, 1);
  std::vector<std::string> log;
  auto checkpoint = checkpoint_in(directory, 2, 2, ps::Consistency::BSP, &log);
  Job job(ps::Consistency::BSP, 0, 2, 3); // table 2 is read-only
  auto settle = [&] {
    job.engine.apply_full_rounds(job.tables, [&](ps::Table& table) { checkpoint.round_applied(table, job.tables); });
  };
  auto push = [&](int worker, int table) {
    const int64_t clock = job.tables[table]->pushes[worker];
    job.engine.contribute(worker, *job.tables[table], at::Tensor(),
                          at::full({1}, gradient(worker, clock), at::kDouble), job.now);
    settle();
  };
  push(0, 1); // table 1's round 0 opens: table 1 is pushed to, so the checkpoint waits for it
  for (int round = 0; round < 2; ++round) {
    push(0, 0);
    push(1, 0);
  }
  CHECK_FALSE(std::filesystem::exists(path)); // table 1 has not reached clock 2
  const double table0_at_2 = value_of(*job.tables[0]);
  push(0, 0); // worker 0 ahead on table 0: not in the checkpoint
  push(1, 1);
  push(0, 1);
  CHECK_FALSE(std::filesystem::exists(path));
  push(1, 1);
  REQUIRE(std::filesystem::exists(path));
  CHECK_THAT(log.back(), Contains("checkpoint at clock 2 written to"));

  auto restored = checkpoint_in(directory, 2, 2, ps::Consistency::BSP);
  CHECK(restored.holds("t0"));
  CHECK(restored.holds("t2"));
  CHECK_FALSE(restored.holds("elsewhere"));
  Job resumed(ps::Consistency::BSP, 0, 2, 3);
  for (const auto& table : resumed.tables) {
    REQUIRE(restored.restore(*table));
    resumed.engine.resume_restored(*table);
  }
  CHECK(resumed.tables[0]->pushes == std::vector<int64_t>{2, 2});
  CHECK(resumed.tables[0]->applied == 2);
  CHECK(value_of(*resumed.tables[0]) == Approx(table0_at_2));
  CHECK(resumed.tables[1]->applied == 2);
  CHECK(resumed.tables[2]->pushes == std::vector<int64_t>{0, 0});
  auto unknown = make_table("elsewhere", 2);
  CHECK_FALSE(restored.restore(*unknown));
}

TEST_CASE("server checkpoint: ASP and SSP write when the slowest worker passes the next multiple") {
  TemporaryDirectory directory;
  const auto path = ps::checkpoint_path(directory.path.string(), 0, 1);
  auto checkpoint = checkpoint_in(directory, 3, 2, ps::Consistency::SSP);
  Job job(ps::Consistency::SSP, 5, 2);
  for (int i = 0; i < 4; ++i) job.push(0);
  job.push(1);
  job.push(1);
  checkpoint.clock_reached(job.engine.common_clock(job.tables), job.tables);
  CHECK_FALSE(std::filesystem::exists(path)); // the slowest is at 2
  job.push(1);
  checkpoint.clock_reached(job.engine.common_clock(job.tables), job.tables);
  REQUIRE(std::filesystem::exists(path));
  std::filesystem::remove(path);
  checkpoint.clock_reached(job.engine.common_clock(job.tables), job.tables);
  CHECK_FALSE(std::filesystem::exists(path)); // clock 3 is written once

  for (int i = 0; i < 3; ++i) job.push(1);
  for (int i = 0; i < 3; ++i) job.push(0);
  checkpoint.clock_reached(job.engine.common_clock(job.tables), job.tables);
  REQUIRE(std::filesystem::exists(path)); // clock 6: each worker's own pushes are kept

  auto restored = checkpoint_in(directory, 3, 2, ps::Consistency::SSP);
  auto table = make_table("t0", 2);
  REQUIRE(restored.restore(*table));
  CHECK(table->pushes == std::vector<int64_t>{7, 6});
  CHECK(value_of(*table) == Approx(value_of(*job.tables[0])));
}

TEST_CASE("server checkpoint: the end is checkpointed only after a clean finish, and a foreign file is refused") {
  TemporaryDirectory directory;
  auto checkpoint = checkpoint_in(directory, 0, 2, ps::Consistency::ASP);
  ps::Tables none;
  ps::Tables some;
  some.push_back(make_table("w", 2));
  CHECK(checkpoint.due_at_end(some, true));
  CHECK_FALSE(checkpoint.due_at_end(some, false)); // every worker lost: the last agreed checkpoint stays
  CHECK_FALSE(checkpoint.due_at_end(none, true));
  CHECK_FALSE(ps::ServerCheckpoint("", 0, 0, 1, 2, ps::Consistency::ASP, [](const std::string&) {})
                  .due_at_end(some, true));

  checkpoint.write(some, "at the end");
  CHECK_THROWS_WITH(checkpoint_in(directory, 0, 3, ps::Consistency::ASP),
                    Contains("was written for 2 workers, this job has 3"));
}
