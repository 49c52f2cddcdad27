// plan/cost_model and plan/planner: predictions against hand-computed cases, and the planner's choices
// (and reasons) for models whose answer is known — all in-process, from made-up profiles.
#include "catch_with_torch.h"

#include <torchpar/plan/planner.h>
#include <torchpar/plan/profile.h>

namespace plan = torchpar::plan;
using Catch::Matchers::Contains;

namespace {

constexpr int64_t kMiB = 1 << 20;

// `layers` equal layers profiled at 8 samples: forward 2 ms, backward 1 + 1 ms, 800 activation bytes.
plan::ModelProfile equal_layers(int layers, int64_t parameter_bytes) {
  plan::ModelProfile model;
  model.batch = 8;
  for (int i = 0; i < layers; ++i) {
    model.layers.push_back({"layer" + std::to_string(i), 2.0, 1.0, 1.0, parameter_bytes, 800, 400});
  }
  return model;
}

// A reduce-scatter and an all-gather each send half of an all-reduce's bytes (a ring's two halves).
plan::NetworkProfile network(double alpha_ms, double ms_per_mib) {
  plan::NetworkProfile network;
  network.all_reduce = {alpha_ms, ms_per_mib / kMiB};
  network.send_recv = {alpha_ms, ms_per_mib / kMiB};
  network.all_gather = network.reduce_scatter = {alpha_ms, ms_per_mib / 2 / kMiB};
  return network;
}

plan::TrainingSetup batch_of(int64_t batch, double optimizer_state_factor = 1) {
  plan::TrainingSetup setup;
  setup.batch = batch;
  setup.optimizer_state_factor = optimizer_state_factor;
  return setup;
}

// Each layer's tensor-parallel role, in words (within each stage of `balance`, if given).
std::string roles(const plan::ModelProfile& model, const std::vector<int64_t>& balance = {}) {
  std::string words;
  for (const auto role : balance.empty() ? plan::tensor_parallel_roles(model)
                                         : plan::tensor_parallel_roles(model, balance)) {
    if (!words.empty()) words += " ";
    words += role == plan::TensorRole::Column ? "column"
             : role == plan::TensorRole::Row  ? "row"
             : role == plan::TensorRole::ColumnGathered ? "gathered"
             : role == plan::TensorRole::Elementwise    ? "elementwise"
                                                        : "whole";
  }
  return words;
}

} // namespace

TEST_CASE("plan: buckets overlapping backward go out one at a time, each once it is ready") {
  CHECK(plan::overlapped_finish_ms({1, 3}, {2, 1}, 3) == Approx(4));   // 1-3, 3-4
  CHECK(plan::overlapped_finish_ms({1, 1.5}, {2, 1}, 3) == Approx(4));  // the second waits for the first
  CHECK(plan::overlapped_finish_ms({1}, {1}, 5) == Approx(5));          // hidden behind backward
  CHECK(plan::overlapped_finish_ms({}, {}, 2) == Approx(2));
  // Without a spare core the buckets follow backward (3 + 2 + 1); half the overlap saves half the 2 ms.
  CHECK(plan::overlapped_finish_ms({1, 3}, {2, 1}, 3, 0.0) == Approx(6));
  CHECK(plan::overlapped_finish_ms({1, 3}, {2, 1}, 3, 0.5) == Approx(5));
}

TEST_CASE("plan: DDP on 2 ranks with a known bucket layout and link cost") {
  plan::Configuration ddp;
  ddp.world = 2;
  // 2 layers of 2 MiB; caps {1 MiB, 25 MiB}: layer 1 alone in the first bucket, layer 0 in the second.
  // 4 samples per rank: forward 1 + 1 ms; backward: layer 1 done at 1 ms, layer 0 at 2 ms. Each bucket's
  // all-reduce 0.5 + 2 ms: 1-3.5 and 3.5-6. Step: 2 + 6 = 8 ms.
  const auto p = plan::predict(equal_layers(2, 2 * kMiB), network(0.5, 1), batch_of(8), ddp);
  CHECK(p.step_ms == Approx(8));
  CHECK(p.compute_ms == Approx(4));
  CHECK(p.exposed_comm_ms == Approx(4));
  CHECK(p.samples_per_second == Approx(1000));
  // Parameters, gradients, bucket copies, momentum (4 x 4 MiB); activations of 4 samples (2 x 400).
  CHECK(p.memory_per_rank == 16 * kMiB + 800);
  CHECK(p.bytes_per_step == 4 * kMiB);  // ring all-reduce: 2 (n - 1) / n of the parameters
}

TEST_CASE("plan: sharded data parallelism's stages on 2 ranks with known link costs") {
  // 2 layers of 2 MiB, 4 samples per rank: forward 1 + 1 ms; backward: layer 1 done at 1 ms, layer 0 at 2 ms.
  // Reduce-scatter and all-gather 0.5 ms + 1 ms per MiB (of the whole tensor); copies free; SGD with momentum.
  plan::NetworkProfile net;
  net.reduce_scatter = net.all_gather = {0.5, 1.0 / kMiB};
  plan::Configuration sharded;
  sharded.strategy = plan::Strategy::Sharded;
  sharded.world = 2;
  const auto model = equal_layers(2, 2 * kMiB);
  {
    // DDP's caps by default: a first bucket of 1 MiB takes the last layer alone, reduce-scattered while backward
    // goes on. Four layers: 4 + the reduce-scatters (1 - 3.5 and, of the other three, 4 - 10.5) + the all-gathers
    // (2.5 + 6.5); without the small first bucket 4 + (4 - 12.5) + 8.5.
    const auto four = equal_layers(4, 2 * kMiB);
    sharded.zero_stage = 2;
    CHECK(plan::predict(four, net, batch_of(8), sharded).step_ms == Approx(23.5));
    sharded.first_bucket_bytes = 25 << 20;
    CHECK(plan::predict(four, net, batch_of(8), sharded).step_ms == Approx(25));
  }
  // Stages 1-2 with one 25 MiB bucket (no small first one), reduce-scattered once backward ends (2 - 6.5 ms), then
  // the updated shards all-gathered (4.5 ms, exposed): 2 + 6.5 + 4.5.
  sharded.zero_stage = 2;
  const auto stage2 = plan::predict(model, net, batch_of(8), sharded);
  CHECK(stage2.configuration.describe() == "sharded zero-2, 2 replicas");
  CHECK(stage2.step_ms == Approx(13));
  CHECK(stage2.exposed_comm_ms == Approx(4.5 + 4.5));
  // The whole parameters (4 MiB), the shard and its momentum (2 MiB each); the one bucket's gradients (4 MiB) as
  // they are copied into its flat input (4 MiB), as much as that input, its reduced piece and the last layer's
  // gradients, alive until the hook that sends the bucket returns (4 + 2 + 2 MiB); activations.
  CHECK(stage2.memory_per_rank == 16 * kMiB + 800);
  CHECK(stage2.tensor_memory_per_rank == stage2.memory_per_rank);  // no shm group, no heap or process lines
  std::string lines;
  for (const auto& line : stage2.memory.lines) lines += line.what + "\n";
  CHECK_THAT(lines, Contains("reduce-scatter buffers in flight"));
  CHECK(stage2.bytes_per_step == 4 * kMiB);  // DDP's: a ring reduce-scatter and all-gather
  sharded.zero_stage = 1;
  const auto stage1 = plan::predict(model, net, batch_of(8), sharded);
  CHECK(stage1.step_ms == Approx(13));
  // Every gradient kept (4 MiB), the bucket's flat input, its output and the shard's averaged gradient (4 + 2 + 2).
  CHECK(stage1.memory_per_rank == 20 * kMiB + 800);
  // Stage 3: each layer a unit, reduce-scattered as its backward ends (1 - 3.5, 3.5 - 6 ms), each gathered before
  // its forward and its backward (4 x 2.5 ms, exposed): 2 + 6 + 10.
  sharded.zero_stage = 3;
  const auto stage3 = plan::predict(model, net, batch_of(8), sharded);
  CHECK(stage3.step_ms == Approx(18));
  // The shard and its momentum (4 MiB); as backward ends both layers' reduce-scatters in flight (2 x (2 + 1) MiB)
  // and the shard's averaged gradient (2 MiB) made as the first is waited for (each layer's parameters are freed
  // as its gradients go).
  CHECK(stage3.memory_per_rank == 12 * kMiB + 800);
  CHECK(stage3.bytes_per_step == 6 * kMiB);  // 1.5x DDP's
  {
    // Ten layers of 1 MiB: as a layer goes out (its gradients, flat input and piece, 1 + 1.5 MiB) two before it are
    // still in flight (2 x 1.5 MiB) until the oldest is waited for, the earlier ones done: backward adds 5.5 MiB,
    // the shard's averaged gradient (5 MiB) and the activations to the shard and its momentum (2 x 5 MiB). Over
    // Gloo each in flight also holds a clone of its input (3 MiB more). With Adam the step's temporaries on the
    // shard (2 x 5 MiB, beside its gradient) outgrow backward.
    const auto ten = equal_layers(10, kMiB);
    CHECK(plan::predict(ten, net, batch_of(8), sharded).tensor_memory_per_rank == 20 * kMiB + kMiB / 2 + 4000);
    auto over_gloo = net;
    over_gloo.reduce_scatter_clones_input = true;
    CHECK(plan::predict(ten, over_gloo, batch_of(8), sharded).tensor_memory_per_rank ==
          23 * kMiB + kMiB / 2 + 4000);
    const auto adam = plan::predict(ten, net, batch_of(8, 2), sharded);
    CHECK(adam.tensor_memory_per_rank == 30 * kMiB);
    std::string adam_lines;
    for (const auto& line : adam.memory.lines) adam_lines += line.what + "\n";
    CHECK_THAT(adam_lines, Contains("the optimizer step's temporaries (on the shard)"));
  }
  // Beside a same-host Gloo group, through the shm group DDP's buckets use: half its all-reduce each (0.5 ms +
  // 0.5 ms per MiB here, against 1 ms per MiB through the group): 2 + 4 + 4 x 1.5.
  net.ddp_all_reduce = plan::LinkCost{0.5, 1.0 / kMiB};
  CHECK(plan::predict(model, net, batch_of(8), sharded).step_ms == Approx(12));
  net.ddp_all_reduce.reset();
  sharded.zero_stage = 4;
  CHECK_THROWS_WITH(plan::predict(model, net, batch_of(8), sharded), Contains("ZeRO stage 4 (1, 2 or 3)"));
  // The planner offers the three stages beside DDP, and its code for them.
  plan::Planner planner(model, net, batch_of(8));
  std::string offered;
  for (const auto& c : planner.candidates(plan::PlanOptions().world(2))) offered += c.describe() + "\n";
  CHECK_THAT(offered, Contains("ddp, 2 replicas\nsharded zero-1, 2 replicas\nsharded zero-2, 2 replicas\n"
                               "sharded zero-3, 2 replicas\n"));
  CHECK_THAT(plan::python_code(stage3.configuration), Contains("torchpar.ShardedDataParallel(model, stage=3"));
  CHECK_THAT(plan::cpp_code(stage2.configuration), Contains(".process_group(group).stage(2));"));
}

TEST_CASE("plan: DDP's buckets take the same-host link where one is measured, the group's all-reduce otherwise") {
  plan::Configuration ddp;
  ddp.world = 2;
  auto beside = network(0.5, 1);
  // As above, but the buckets go through a same-host group at 0.25 + 1 ms each: 1-2.25 and 2.25-3.5, so
  // the step is 2 + 3.5; the group's own all-reduce (0.5 + 2 ms) no longer counts.
  beside.ddp_all_reduce = plan::LinkCost{0.25, 0.5 / kMiB};
  CHECK(plan::predict(equal_layers(2, 2 * kMiB), beside, batch_of(8), ddp).step_ms == Approx(5.5));
  beside.ddp_all_reduce.reset();
  CHECK(plan::predict(equal_layers(2, 2 * kMiB), beside, batch_of(8), ddp).step_ms == Approx(8));
}

TEST_CASE("plan: DDP copies gradients into buckets and back unless it averages them in place, and without overlap all-reduces after backward") {
  plan::Configuration ddp;
  ddp.world = 2;
  auto net = network(0.5, 1);
  net.copy = {0, 0.25 / kMiB};
  // As above, and each layer's 2 MiB of gradients copied into its bucket (0.5 ms) as it becomes final:
  // backward ends at 1.5 and 3 ms; the buckets' all-reduces (2.5 ms each) run 1.5-4 and 4-6.5; then the
  // 4 MiB copied back (1 ms). Step: 2 + 6.5 + 1.
  const auto p = plan::predict(equal_layers(2, 2 * kMiB), net, batch_of(8), ddp);
  CHECK(p.step_ms == Approx(9.5));
  // No overlap: backward (3 ms), then both all-reduces (5 ms), then the copy back: 2 + 8 + 1.
  plan::Calibration serial;
  serial.overlap = 0;
  CHECK(plan::predict(equal_layers(2, 2 * kMiB), net, batch_of(8), ddp, serial).step_ms == Approx(11));
  // Averaged where they lie (an shm data group): backward ends at 1 and 2 ms, the all-reduces run 1-3.5 and
  // 3.5-6, nothing is copied back. Step: 2 + 6.
  net.ddp_in_place = true;
  CHECK(plan::predict(equal_layers(2, 2 * kMiB), net, batch_of(8), ddp).step_ms == Approx(8));
  net.ddp_in_place = false;
  // One rank neither copies nor communicates.
  ddp.world = 1;
  CHECK(plan::predict(equal_layers(2, 2 * kMiB), net, batch_of(8), ddp).step_ms == Approx(4 + 4));
}

TEST_CASE("plan: a layer's fixed overhead does not shrink with the samples") {
  auto model = equal_layers(2, 2 * kMiB);
  for (auto& layer : model.layers) layer.forward_overhead_ms = 1.0;  // forward 2 ms at 8 samples, 1 ms of it fixed
  plan::Configuration ddp;
  ddp.world = 2;
  const auto p = plan::predict(model, network(0, 0), batch_of(8), ddp);
  CHECK(p.compute_ms == Approx(2 * (1 + 1 * 4.0 / 8) + 2 * 1));  // forwards of 1.5 ms, backwards of 1 ms
}

TEST_CASE("plan: a pipeline's step is the simulator's makespan of its stage costs") {
  plan::Configuration pipe;
  pipe.strategy = plan::Strategy::Pipeline;
  pipe.world = 2;
  pipe.schedule = torchpar::pipeline::ScheduleKind::GPipe;
  pipe.microbatches = 2;
  // One layer per stage, micro-batches of 4: F = 1, B = 1 ms, free links. GPipe: (m + p - 1)(F + B) = 6 ms,
  // a bubble of 1 - m(F + B) / makespan = 1/3.
  const auto p = plan::predict(equal_layers(2, 2 * kMiB), network(0, 0), batch_of(8), pipe);
  CHECK(p.balance == std::vector<int64_t>{1, 1});
  CHECK(p.step_ms == Approx(6));
  CHECK(p.bubble_fraction == Approx(1.0 / 3));
  CHECK(p.compute_ms == Approx(4));
  // Its layer's parameters, gradients and momentum, and the second micro-batch's gradients before they are added
  // to the first's (2 MiB); GPipe keeps both micro-batches' activations (2 x 400); the first stage's backward holds
  // the gradient the second sent back (200).
  CHECK(p.memory_per_rank == 8 * kMiB + 800 + 200);
  // Sends: 2 micro-batches of the boundary's 200 bytes (400 at 8 samples).
  CHECK(p.bytes_per_step == 400);
  // Zero-bubble schedules keep each layer's output gradient from a micro-batch's input gradients (I) to its
  // weight gradients (W): one or two micro-batches' 200 bytes here, none under GPipe.
  const auto line_bytes = [](const plan::Prediction& prediction, const std::string& what) {
    int64_t bytes = -1;
    for (const auto& line : prediction.memory.lines) {
      if (line.what == what) bytes = line.bytes;
    }
    return bytes;
  };
  const std::string kept_for_w = "output gradients kept for the weight gradients (W)";
  CHECK(line_bytes(p, kept_for_w) == -1);
  pipe.schedule = torchpar::pipeline::ScheduleKind::ZeroBubbleH1;
  const auto zero_bubble = plan::predict(equal_layers(2, 2 * kMiB), network(0, 0), batch_of(8), pipe);
  CHECK((line_bytes(zero_bubble, kept_for_w) == 200 || line_bytes(zero_bubble, kept_for_w) == 400));
  pipe.schedule = torchpar::pipeline::ScheduleKind::GPipe;

  // Transfers of 1 ms, activations forward and gradients back: one more ms each way on the critical path.
  auto slow = plan::predict(equal_layers(2, 2 * kMiB), network(1, 0), batch_of(8), pipe);
  CHECK(slow.step_ms == Approx(p.step_ms + 2));
  // Through same-host rings the transfers cost the stages' own link, not the group's send/recv.
  auto through_rings = network(1, 0);
  through_rings.stage_transfer = plan::LinkCost{0.25, 0};
  CHECK(plan::predict(equal_layers(2, 2 * kMiB), through_rings, batch_of(8), pipe).step_ms == Approx(p.step_ms + 0.5));
  // ... which slows with the load as the group's links do.
  plan::Calibration loaded;
  loaded.communication_scale = 2;
  CHECK(plan::predict(equal_layers(2, 2 * kMiB), through_rings, batch_of(8), pipe, loaded).step_ms >
        p.step_ms + 0.5 + 1e-6);
}

TEST_CASE("plan: a parameter server's step is the slower of a worker and a server") {
  plan::Configuration ps;
  ps.strategy = plan::Strategy::ParameterServer;
  ps.world = 3;  // 2 workers and a server, BSP
  // Workers: 4 samples, forward 2 ms, backward 2 ms, then one 4 MiB bucket pushed and pulled: 2 x 0.1 + 2 x 4 ms
  // = 8.2 ms, and under BSP the server takes the other worker's push first (4.1 ms): a worker's step is 16.3 ms.
  // The server receives and answers both workers: 2 x (0.1 + 8) = 16.2 ms.
  const auto p = plan::predict(equal_layers(2, 2 * kMiB), network(0.1, 1), batch_of(8), ps);
  CHECK(p.step_ms == Approx(16.3));
  // A worker: parameters, gradients and the values first pulled (12 MiB) and its activations; the server
  // (BSP): its 4 MiB share, momentum, and each worker's push twice until the round is applied: 6 x 4 MiB.
  CHECK(p.memory_per_rank == 24 * kMiB);
  CHECK(p.bytes_per_step == 16 * kMiB);        // the server: both workers' pushes and pulls

  // Copies of 0.25 ms/MiB and an optimizer of 0.5 ms/MiB. A worker's round trip: push and pull (8.2 ms),
  // the worker's copy into the push and out of the reply (2 ms), the server's optimizer (2 ms) and
  // its copy into the reply (1 ms): 13.2, and the other worker's push received and copied (4.1 + 1): a step of
  // 22.3 ms. The server: 2 x (8.1 + 1) + 2 = 20.2 ms.
  auto net = network(0.1, 1);
  net.copy = {0, 0.25 / kMiB};
  auto setup = batch_of(8);
  setup.optimizer_ms_per_byte = 0.5 / kMiB;
  CHECK(plan::predict(equal_layers(2, 2 * kMiB), net, setup, ps).step_ms == Approx(22.3));

  // Every rank on one host: the 4 MiB payloads go through the rings, each behind a 16 KiB frame
  // (0.1 + 1/64 ms) with a copy in and out (2 x 1 ms): 2.1156 ms a transfer instead of 4.1. A worker's
  // round trip: 2 x 2.1156 + 2 + 2 + 1 = 9.23 ms and the other's push (2.1156 + 1), its step 16.35; the server:
  // 2 x (2 x 2.1156 + 1) + 2 = 12.46 ms. Both ends map the pages of both rings of each channel that the
  // 4 MiB payloads reach: the server 2 x 8 MiB more, the worker 8. (The server's values are then pages its
  // workers map too, not a tensor: the same bytes of its resident set.)
  net.ps_ring_bytes = 64 * kMiB;
  const auto one_host = plan::predict(equal_layers(2, 2 * kMiB), net, setup, ps);
  CHECK(one_host.step_ms == Approx(16.346875));
  CHECK(one_host.memory_per_rank == (24 + 2 * 8) * kMiB);
  CHECK(one_host.tensor_memory_per_rank == 20 * kMiB);
  // ASP: each push applied as it arrives, the optimizer once per push: a worker's step 13.23 ms, the server's
  // 2 x (2 x 2.1156 + 1) + 2 x 2 = 14.46 ms, faster than BSP.
  ps.synchronous = false;
  CHECK(plan::predict(equal_layers(2, 2 * kMiB), net, setup, ps).step_ms == Approx(14.4625));
  ps.synchronous = true;
  net.ps_ring_bytes = 2 * kMiB;  // payloads larger than the ring go through Gloo
  CHECK(plan::predict(equal_layers(2, 2 * kMiB), net, setup, ps).step_ms == Approx(22.3));

  // A table of sparse rows adds the calibration's fixed cost of their pull and push to a worker's step
  // (here the bottleneck), and nothing to a model without one.
  plan::Calibration rows_cost;
  rows_cost.ps_rows_ms = 3;
  net.ps_ring_bytes = 64 * kMiB;
  CHECK(plan::predict(equal_layers(2, 2 * kMiB), net, setup, ps, rows_cost).step_ms == Approx(16.346875));
  auto with_rows = equal_layers(2, 2 * kMiB);
  with_rows.layers[0].sparse_parameter_bytes = 2 * kMiB;
  with_rows.layers[0].sparse_bytes_per_sample = 1024;
  const double without_cost = plan::predict(with_rows, net, setup, ps).step_ms;
  CHECK(plan::predict(with_rows, net, setup, ps, rows_cost).step_ms == Approx(without_cost + 3));

  ps.world = 4;  // 3 workers of 8 / 3 samples do not divide
  CHECK_THROWS_WITH(plan::predict(equal_layers(2, 2 * kMiB), net, setup, ps),
                    Contains("does not divide into 3 workers"));
}

TEST_CASE("plan: compute and communication slow with the ranks computing at once") {
  auto model = equal_layers(2, 2 * kMiB);
  model.contention = 2.0;  // measured: twice as slow with every rank computing
  plan::Configuration ddp;
  ddp.world = 2;
  // Every rank computes: forwards and backwards twice as long (the first case's 1 ms passes take 2),
  // so the layers' gradients are final at 2 and 4 ms; the buckets' all-reduces run 2-4.5 and 4.5-7.
  CHECK(plan::predict(model, network(0.5, 1), batch_of(8), ddp).step_ms == Approx(4 + 7));
  plan::Calibration loaded;
  loaded.communication_scale = 2.0;  // all-reduces of 5 ms: 2-7 and 7-12
  CHECK(plan::predict(model, network(0.5, 1), batch_of(8), ddp, loaded).step_ms == Approx(4 + 12));
  // The optimizer's step (0.5 ms per MiB alone) shares the cores likewise: 4 MiB in 2 ms alone, 4 with both ranks.
  auto with_optimizer = batch_of(8);
  with_optimizer.optimizer_ms_per_byte = 0.5 / kMiB;
  CHECK(plan::predict(model, network(0.5, 1), with_optimizer, ddp).step_ms == Approx(4 + 7 + 4));
  ddp.world = 1;  // alone: 8 samples, forward 2 x 2 ms, backward 2 x 2 ms (no contention), the step 2 ms
  CHECK(plan::predict(model, network(0.5, 1), with_optimizer, ddp).step_ms == Approx(8 + 2));
  ddp.world = 2;

  // A pipeline's ranks compute together only outside its bubble. GPipe over 2 ranks: 1 micro-batch
  // keeps one rank busy at a time (no contention); 2 micro-batches leave a bubble of 1/3, so 4/3
  // ranks compute at once on average: compute 1 + (2 - 1) / 3 times slower.
  plan::Configuration pipe;
  pipe.strategy = plan::Strategy::Pipeline;
  pipe.world = 2;
  pipe.schedule = torchpar::pipeline::ScheduleKind::GPipe;
  const auto alone = plan::predict(equal_layers(2, 2 * kMiB), network(0, 0), batch_of(8), pipe);
  CHECK(plan::predict(model, network(0, 0), batch_of(8), pipe).step_ms == Approx(alone.step_ms));
  pipe.microbatches = 2;
  const auto two_alone = plan::predict(equal_layers(2, 2 * kMiB), network(0, 0), batch_of(8), pipe);
  CHECK(two_alone.bubble_fraction == Approx(1.0 / 3));
  CHECK(plan::predict(model, network(0, 0), batch_of(8), pipe).step_ms == Approx(two_alone.step_ms * 4 / 3));

  // Its transfers (and a tensor group's collectives) slow with the load likewise: with 1 micro-batch one
  // rank computes at a time, and the loaded network costs what the idle one does.
  pipe.microbatches = 1;
  const auto idle = plan::predict(model, network(0.5, 1), batch_of(8), pipe);
  CHECK(idle.step_ms > alone.step_ms);  // the transfers count
  CHECK(plan::predict(model, network(0.5, 1), batch_of(8), pipe, loaded).step_ms == Approx(idle.step_ms));
  pipe.microbatches = 2;
  CHECK(plan::predict(model, network(0.5, 1), batch_of(8), pipe, loaded).step_ms >
        plan::predict(model, network(0.5, 1), batch_of(8), pipe).step_ms);
}

TEST_CASE("plan: a profile scaled to a measured pass keeps its shape") {
  auto model = equal_layers(2, kMiB);
  model.layers[0].forward_overhead_ms = 1.0;
  CHECK(model.compute_ms() == Approx(8));
  const auto scaled = model.scaled_to(12);
  CHECK(scaled.compute_ms() == Approx(12));
  CHECK(scaled.layers[0].forward_ms == Approx(3));
  CHECK(scaled.layers[0].forward_overhead_ms == Approx(1.5));
  CHECK(scaled.layers[1].backward_weight_ms == Approx(1.5));
  CHECK(scaled.parameter_bytes() == model.parameter_bytes());
  CHECK_THROWS_WITH(model.scaled_to(0), Contains("cannot scale"));
}

TEST_CASE("plan: the calibration fit recovers what made the measurements, from samples of two models") {
  plan::Calibration truth;
  truth.compute_scale = 1.5;
  truth.per_action_ms = 0.2;
  truth.per_step_ms = 1.0;
  std::vector<plan::CalibrationSample> samples;
  for (const auto& model : {equal_layers(2, 2 * kMiB), equal_layers(4, kMiB)}) {
    for (int microbatches : {1, 2, 4}) {
      plan::CalibrationSample sample{model, network(0.1, 1), batch_of(8), {}, 0};
      sample.configuration.strategy = plan::Strategy::Pipeline;
      sample.configuration.world = 2;
      sample.configuration.microbatches = microbatches;
      samples.push_back(sample);
    }
    plan::CalibrationSample ddp{model, network(0.1, 1), batch_of(8), {}, 0};
    ddp.configuration.world = 2;
    samples.push_back(ddp);
  }
  double worst_before = 0;  // uncalibrated: far off, so the fit has something to learn
  for (auto& sample : samples) {
    sample.measured_ms = plan::predict(sample.model, sample.network, sample.setup, sample.configuration, truth).step_ms;
    const double uncalibrated =
        plan::predict(sample.model, sample.network, sample.setup, sample.configuration).step_ms;
    worst_before = std::max(worst_before, std::abs(uncalibrated - sample.measured_ms) / sample.measured_ms);
  }
  CHECK(worst_before > 0.3);
  const auto fitted = plan::fit_calibration(samples);
  for (const auto& sample : samples) {
    INFO(sample.configuration.describe());
    const double predicted =
        plan::predict(sample.model, sample.network, sample.setup, sample.configuration, fitted).step_ms;
    CHECK(predicted == Approx(sample.measured_ms).epsilon(0.02));
  }
  CHECK(fitted.compute_scale == Approx(1.5).margin(0.06));
  CHECK_THROWS_WITH(plan::fit_calibration({}), Contains("no measured configuration"));
}

TEST_CASE("plan: tensor parallelism splits Linear layers in column-row pairs and sums over the group") {
  // 3 layers; the first two Linear 64 -> 64 (a column-row pair), the third not splittable. At 8 samples:
  // forward 2 ms, backward 1 + 1, input 400 bytes, output 400, 800 left alive by each forward.
  auto model = equal_layers(3, kMiB);
  for (auto& layer : model.layers) layer.input_bytes = 400;
  for (int i : {0, 1}) model.layers[i].in_features = model.layers[i].out_features = 64;
  CHECK(roles(model) == "column row whole");
  plan::Configuration tensor;
  tensor.strategy = plan::Strategy::TensorParallel;
  tensor.world = 2;
  // Every rank computes the whole batch: the pair's 8 ms halved, the third layer's 4 ms whole; one
  // all-reduce of the row layer's output forward (1 ms + 400 B); the column layer is the first, so no
  // input gradient to sum. Memory: half of the pair's 2 MiB and the third's 1 MiB, x (parameters,
  // gradients, momentum), and every layer's activations of 8 samples with the first one's input.
  const auto net = network(1, 0);
  const auto p = plan::predict(model, net, batch_of(8), tensor);
  CHECK(p.step_ms == Approx(4 + 4 + 1));
  CHECK(p.memory_per_rank == 2 * kMiB * 3 + 3 * 800 + 400);
  CHECK(p.bytes_per_step == 400);  // one all-reduce of 400 bytes over 2 ranks moves 2 (2 - 1) / 2 of them
  // A pair in the middle: the column layer sums its input's gradient too; alone, a layer is gathered.
  model.layers[2].in_features = model.layers[2].out_features = 64;
  model.layers[0].in_features = model.layers[0].out_features = 0;
  CHECK(roles(model) == "whole column row");
  CHECK(plan::predict(model, net, batch_of(8), tensor).step_ms == Approx(4 + 4 + 2));
  model.layers[2].in_features = model.layers[2].out_features = 0;
  CHECK(roles(model) == "whole gathered whole");
  // An activation between two Linear layers runs on the split at half its time, with no collective; a cut after
  // it leaves the first Linear alone, gathered.
  auto with_activation = model;
  with_activation.layers[0].in_features = with_activation.layers[0].out_features = 64;
  with_activation.layers[1].in_features = with_activation.layers[1].out_features = 0;
  with_activation.layers[1].elementwise = true;
  with_activation.layers[2].in_features = with_activation.layers[2].out_features = 64;
  CHECK(roles(with_activation) == "column elementwise row");
  CHECK(plan::predict(with_activation, net, batch_of(8), tensor).step_ms == Approx(2 + 2 + 2 + 1));
  CHECK(roles(with_activation, {2, 1}) == "gathered whole gathered");
  // 2 replicas of 2-rank groups: the replica's 4 samples, and the rank's parameters averaged.
  tensor.world = 4;
  tensor.replicas = 2;
  CHECK(plan::predict(model, network(0, 0), batch_of(8), tensor).memory_per_rank ==
        static_cast<int64_t>(2.5 * kMiB * 4) + 3 * 400 + 200);
  // Features that do not divide, and a model with nothing to split, are refused by name.
  model.layers[1].out_features = 63;
  CHECK_THROWS_WITH(plan::predict(model, net, batch_of(8), tensor), Contains("63 output features do not split"));
  CHECK_THROWS_WITH(plan::predict(equal_layers(2, kMiB), net, batch_of(8), tensor),
                    Contains("no layer of the model splits"));
}

TEST_CASE("plan: a pipeline of tensor groups splits each stage's layers, and data replicas average them") {
  // 4 Linear 64 -> 64 layers, 1 MiB each, in 2 stages of 2-rank tensor groups.
  auto model = equal_layers(4, kMiB);
  for (auto& layer : model.layers) {
    layer.in_features = layer.out_features = 64;
    layer.input_bytes = 400;
  }
  CHECK(roles(model, {2, 2}) == "column row column row");
  CHECK(roles(model, {1, 3}) == "gathered column row gathered");  // no pair spans a cut
  plan::Configuration pipe;
  pipe.strategy = plan::Strategy::Pipeline;
  pipe.world = 4;
  pipe.tensor = 2;
  pipe.schedule = torchpar::pipeline::ScheduleKind::GPipe;
  // Collectives measured over the 4 ranks at 3 ms cost 1 ms over 2 (a ring's hops: 1 of 3); free sends.
  plan::NetworkProfile net;
  net.all_reduce = net.all_gather = {3, 0};
  // One micro-batch of 8. Stage 0 (column, row): forward 1 + 1 + the row's all-reduce 1 = 3, backward
  // 2 x (0.5 + 0.5) = 2 (the first layer has no input gradient to sum). Stage 1 (column, row): forward 3,
  // backward 2 + the column's input-gradient all-reduce 1 = 3. GPipe: 3 + 3 + 3 + 2.
  const auto p = plan::predict(model, net, batch_of(8), pipe);
  CHECK(p.configuration.describe() == "pipeline gpipe, 2 stages x 2 tensor, 1 micro-batch");
  CHECK(p.balance == std::vector<int64_t>{2, 2});
  CHECK(p.step_ms == Approx(11));
  // Half of each of its stage's 2 layers x (parameters, gradients, momentum), and the stage's activations
  // with its input; stage 0's backward holds the gradient stage 1 sent back and makes its last layer's input
  // gradient (400 each).
  CHECK(p.memory_per_rank == 3 * kMiB + 2 * 800 + 400 + 800);
  // Stage 1 sends most: the column's input gradient and the row's output summed (400 B each over 2 ranks
  // of a ring), and the gradient back to stage 0 (400 B).
  CHECK(p.bytes_per_step == 1200);

  // 2 data replicas of it on 8 ranks (measured over 8 at 7 ms: 1 ms over each 2-rank group): each replica's
  // 8 samples the same stages, then the stage's parameters averaged over the replicas' group.
  pipe.world = 8;
  pipe.replicas = 2;
  net.all_reduce = net.all_gather = {7, 0};
  const auto grid = plan::predict(model, net, batch_of(16), pipe);
  CHECK(grid.configuration.describe() == "pipeline gpipe, 2 stages x 2 tensor x 2 replicas, 1 micro-batch");
  CHECK(grid.step_ms == Approx(11 + 1));
  CHECK(grid.memory_per_rank == 4 * kMiB + 2 * 800 + 400 + 800);

  // Sizes that do not divide, and layers that do not split, are refused by name.
  pipe.tensor = 3;
  CHECK_THROWS_WITH(plan::predict(model, net, batch_of(16), pipe),
                    Contains("2 replicas x 3 tensor ranks do not divide 8"));
  pipe.tensor = 2;
  model.layers[3].in_features = 63;
  CHECK_THROWS_WITH(plan::predict(model, net, batch_of(16), pipe), Contains("63 input features do not split over 2"));
  // The planner offers pipelines of tensor groups when a layer splits.
  plan::Planner planner(model, net, batch_of(16));
  std::string offered;
  for (const auto& c : planner.candidates(plan::PlanOptions().world(8))) offered += c.describe() + "\n";
  CHECK_THAT(offered, Contains("pipeline 1f1b, 2 stages x 2 tensor x 2 replicas, 8 micro-batches"));
  CHECK_THAT(offered, Contains("pipeline 1f1b, 2 stages x 4 tensor, 8 micro-batches"));
  plan::Planner unsplittable(equal_layers(4, kMiB), net, batch_of(16));
  for (const auto& c : unsplittable.candidates(plan::PlanOptions().world(8))) CHECK(c.tensor == 1);
}

TEST_CASE("plan: α and β come back from measurements on a line") {
  const auto cost = plan::fit_link_cost({1000, 2000, 4000}, {0.3, 0.5, 0.9});
  CHECK(cost.alpha_ms == Approx(0.1));
  CHECK(cost.ms_per_byte == Approx(0.0002));
  CHECK(cost.milliseconds(0) == 0);
  // Off the line, each point counts by its relative error: plain least squares would follow the 4 MiB
  // time and miss the 4 KiB one by 23%.
  const auto noisy = plan::fit_link_cost({4096, 65536, 262144, 4194304}, {0.3, 0.33, 0.5, 6.0});
  CHECK(noisy.milliseconds(4096) == Approx(0.3).epsilon(0.15));
  CHECK(noisy.milliseconds(65536) == Approx(0.33).epsilon(0.05));
  CHECK(noisy.milliseconds(4194304) == Approx(6.0).epsilon(0.15));
}

TEST_CASE("plan: what does not divide or does not fit is excluded with its reason") {
  plan::Planner planner(equal_layers(2, 2 * kMiB), network(0.1, 1), batch_of(8));
  const auto result = planner.plan(plan::PlanOptions().world(3).memory_per_rank(30 * kMiB));
  std::string reasons;
  for (const auto& excluded : result.excluded) {
    reasons += excluded.configuration.describe() + ": " + excluded.reason + "\n";
  }
  CHECK_THAT(reasons, Contains("ddp, 3 replicas: batch 8 does not divide into 3 ranks"));
  CHECK_THAT(reasons, Contains("the model has 2 layers, fewer than the 3 stages"));
  REQUIRE_FALSE(result.ranked.empty());
  for (size_t i = 1; i < result.ranked.size(); ++i) CHECK(result.ranked[i - 1].step_ms <= result.ranked[i].step_ms);
  for (const auto& p : result.ranked) CHECK(p.memory_per_rank <= 30 * kMiB);
  const auto tight = planner.plan(plan::PlanOptions().world(3).memory_per_rank(12 * kMiB));
  CHECK(tight.ranked.empty());
  // The server: under BSP it keeps each worker's push twice (24 MiB), under ASP it applies them as received.
  CHECK_THAT(plan::render_table(tight),
             Contains("ps bsp, 2 workers + 1 server: needs 24.0 MiB per rank, over the 12.0 MiB cap"));
  CHECK_THAT(plan::render_table(tight), Contains("ps asp, 2 workers + 1 server: needs 16.0 MiB per rank"));
  CHECK_THAT(plan::render_table(result), Contains("excluded:"));
}

TEST_CASE("plan: a deep model over the memory cap goes to the pipeline") {
  // 8 layers of 8 MiB: DDP needs 4 x 64 MiB per rank; 4 stages hold 2 layers each.
  plan::Planner planner(equal_layers(8, 8 * kMiB), network(0.05, 0.1), batch_of(64));
  const auto result = planner.plan(plan::PlanOptions().world(4).memory_per_rank(100 * kMiB));
  REQUIRE_FALSE(result.ranked.empty());
  CHECK(result.ranked.front().configuration.strategy == plan::Strategy::Pipeline);
  bool ddp_over_cap = false;
  for (const auto& excluded : result.excluded) {
    if (excluded.configuration.strategy == plan::Strategy::DataParallel) {
      ddp_over_cap = excluded.reason.find("over the 100.0 MiB cap") != std::string::npos;
    }
  }
  CHECK(ddp_over_cap);
  CHECK_THAT(result.recommended_python, Contains("torchpar.pipeline.Pipeline(layers, loss_fn"));
  CHECK_THAT(result.recommended_cpp, Contains("torchpar::pipeline::PipelineOptions()"));
  // What the planner measured with, so that the training it recommends runs as predicted.
  CHECK_THAT(result.recommended_python, Contains("torchpar.keep_freed_memory()"));
  CHECK_THAT(result.recommended_cpp, Contains("torchpar::keep_freed_memory();"));
  // Without the cap the same model trains fastest with DDP (its compute splits 4 ways, its all-reduces
  // hide behind backward).
  const auto uncapped = planner.plan(plan::PlanOptions().world(4));
  CHECK(uncapped.ranked.front().configuration.strategy == plan::Strategy::DataParallel);
}

TEST_CASE("plan: a wide embedding model over the memory cap goes to the parameter server") {
  // A 64 MiB embedding table (little compute; each sample touches 8 rows of 256 bytes) and a small MLP,
  // Adam (2 bytes of state per parameter byte). DDP holds the table with gradients, Adam's two moments
  // and the buckets' copies (5 x 64 MiB), a pipeline's first stage 4 x 64 MiB (a layer is not cut). The
  // parameter server keeps the table on the servers as sparse rows: 2 servers hold half of it with its
  // state, grown by doubling (the values and Adam's two moments grown to 32 MiB each in turn, the last beside its
  // old 16 MiB: 112 MiB), and the MLP's share; a worker the MLP and the rows its 32 samples touch. One server would
  // hold 224 MiB.
  plan::ModelProfile model = equal_layers(3, kMiB);
  model.layers[0].parameter_bytes = 64 * kMiB;
  model.layers[0].sparse_parameter_bytes = 64 * kMiB;
  model.layers[0].sparse_bytes_per_sample = 8 * 256;
  model.layers[0].forward_ms = 0.1;
  const auto result = plan::Planner(model, network(0.05, 0.5), batch_of(64, 2))
                          .plan(plan::PlanOptions().world(4).memory_per_rank(200 * kMiB));
  REQUIRE_FALSE(result.ranked.empty());
  CHECK(result.ranked.front().configuration.strategy == plan::Strategy::ParameterServer);
  for (const auto& p : result.ranked) {
    CHECK(p.configuration.strategy == plan::Strategy::ParameterServer);
    CHECK(p.configuration.servers == 2);
    // A server: its 1 MiB share of the MLP, Adam's state and temporaries, the pushes (BSP: each of the 2 workers'
    // twice; ASP: once, as received), the table with its state, and the rows pushed (2 x 32 KiB per worker).
    const double dense = p.configuration.synchronous ? 1 + 2 + 4 + 2 : 1 + 2 + 2 + 2;
    CHECK(p.memory_per_rank == Approx((dense + 3.5 * 32 + 2 * 2 * 0.03125) * kMiB).epsilon(0.001));
    CHECK(p.bytes_per_step < 8 * kMiB);  // the MLP and the touched rows, not the table
  }
  CHECK_THAT(result.recommended_cpp, Contains("torchpar::ps::ParameterService"));
  // ZeRO does not fit: the table is one bucket (stage 3: one unit), whose gradient and flat copy for the
  // reduce-scatter (64 MiB each) a rank holds at once beside the parameters (stage 3: the gathered unit).
  std::string sharded_reasons;
  for (const auto& excluded : result.excluded) {
    if (excluded.configuration.strategy == plan::Strategy::Sharded) sharded_reasons += excluded.reason + "\n";
  }
  CHECK(std::count(sharded_reasons.begin(), sharded_reasons.end(), '\n') == 3);
  CHECK_THAT(sharded_reasons, Contains("over the 200.0 MiB cap"));
  // The same table without sparse rows: a worker would hold it 4 times over, and nothing fits.
  model.layers[0].sparse_parameter_bytes = 0;
  const auto dense = plan::Planner(model, network(0.05, 0.5), batch_of(64, 2))
                         .plan(plan::PlanOptions().world(4).memory_per_rank(200 * kMiB));
  CHECK(dense.ranked.empty());
}

TEST_CASE("plan: a pipeline is cut at its fastest cut within the memory cap, not dropped") {
  // Four layers of 4 MiB, the first profiled 3x slower: cut by time alone, 2 stages take [1, 3], whose second
  // stage holds 3 x (4 MiB of parameters, gradients and momentum) and a layer's gradients of the second micro-batch
  // before they are accumulated = 40 MiB; [2, 2] holds 28 MiB.
  auto model = equal_layers(4, 4 * kMiB);
  model.layers[0].forward_ms *= 3;
  model.layers[0].backward_input_ms *= 3;
  model.layers[0].backward_weight_ms *= 3;
  const auto net = network(0.05, 0.1);
  plan::Configuration pipe;
  pipe.strategy = plan::Strategy::Pipeline;
  pipe.world = 2;
  pipe.microbatches = 2;
  const auto by_time = plan::predict(model, net, batch_of(8), pipe);
  REQUIRE(by_time.balance == std::vector<int64_t>{1, 3});
  REQUIRE(by_time.memory_per_rank > 30 * kMiB);

  const auto capped = plan::predict_fastest_cut(model, net, batch_of(8), pipe, {}, 30 * kMiB);
  CHECK(capped.balance == std::vector<int64_t>{2, 2});
  CHECK(capped.memory_per_rank <= 30 * kMiB);

  const auto result = plan::Planner(model, net, batch_of(8))
                          .plan(plan::PlanOptions().world(2).memory_per_rank(30 * kMiB).data_parallel(false)
                                    .sharded(false).parameter_server(false).tensor_parallel(false));
  REQUIRE_FALSE(result.ranked.empty());
  for (const auto& p : result.ranked) {
    CHECK(p.memory_per_rank <= 30 * kMiB);
    if (p.configuration.virtual_stages == 1) CHECK(p.balance == std::vector<int64_t>{2, 2});
  }
  CHECK_THAT(result.recommended_python, Contains("balance=[2, 2]"));

  // Without a cap: the fastest of every cut by the cost model's own prediction (here the cut by time).
  const auto uncapped = plan::predict_fastest_cut(model, net, batch_of(8), pipe);
  for (const std::vector<int64_t>& cut : {std::vector<int64_t>{1, 3}, {2, 2}, {3, 1}}) {
    auto fixed = pipe;
    fixed.balance = cut;
    CHECK(uncapped.step_ms <= plan::predict(model, net, batch_of(8), fixed).step_ms + 1e-9);
  }
  // A cap no cut meets: the leanest cut's need is the reason.
  const auto none = plan::Planner(model, net, batch_of(8))
                        .plan(plan::PlanOptions().world(2).memory_per_rank(10 * kMiB).data_parallel(false)
                                  .sharded(false).parameter_server(false).tensor_parallel(false).microbatches({2}));
  CHECK(none.ranked.empty());
  CHECK_THAT(plan::render_table(none),
             Contains("needs, cut the leanest way, 28.0 MiB per rank, over the 10.0 MiB cap"));
  // Layers that add their weight gradients in themselves (plain Linear layers: pipeline/linear_layer.h) make none
  // apart: [1, 3] then holds 36 MiB, [2, 2] 24, and the cut-aware search counts them the same way.
  for (auto& layer : model.layers) layer.accumulates_weight_gradient = true;
  auto fixed = pipe;
  fixed.balance = {1, 3};
  const auto own = plan::predict(model, net, batch_of(8), fixed);
  CHECK(own.tensor_memory_per_rank == by_time.tensor_memory_per_rank - 4 * kMiB);
  CHECK(own.memory.render().find("before they are accumulated") == std::string::npos);
  const auto leaner = plan::Planner(model, net, batch_of(8))
                          .plan(plan::PlanOptions().world(2).memory_per_rank(10 * kMiB).data_parallel(false)
                                    .sharded(false).parameter_server(false).tensor_parallel(false).microbatches({2}));
  CHECK_THAT(plan::render_table(leaner), Contains("needs, cut the leanest way, 24.0 MiB per rank"));
}

TEST_CASE("plan: with more cuts than it tries, the planner's local search still finds one within the cap") {
  // 24 layers into 8 stages (C(23, 7) = 245157 cuts): the time-balanced cut puts the quick, heavy layers together;
  // one layer moved at a time would stall where two stages are equally over the cap.
  plan::ModelProfile model;
  model.batch = 8;
  for (int i = 0; i < 24; ++i) {
    const bool heavy = i >= 16;  // fast layers with big parameters at the end
    model.layers.push_back({"layer" + std::to_string(i), heavy ? 0.2 : 2.0, heavy ? 0.1 : 1.0, heavy ? 0.1 : 1.0,
                            heavy ? 4 * kMiB : kMiB / 4, 800, 400});
  }
  plan::Configuration pipe;
  pipe.strategy = plan::Strategy::Pipeline;
  pipe.world = 8;
  pipe.microbatches = 8;
  const auto net = network(0.05, 0.1);
  const auto by_time = plan::predict(model, net, batch_of(64), pipe);
  const int64_t cap = 30 * kMiB;
  REQUIRE(by_time.memory_per_rank > cap);
  const auto capped = plan::predict_fastest_cut(model, net, batch_of(64), pipe, {}, cap);
  CHECK(capped.memory_per_rank <= cap);
}

TEST_CASE("plan: the memory model's resident-only lines: rings, the shm segment, the heap's retention, the process") {
  CHECK(plan::ring_pages(16 * kMiB, 100 << 10) == 4 * kMiB + (100 << 10));  // a quarter plus what is in flight
  CHECK(plan::ring_pages(16 * kMiB, 20.0 * kMiB) == 16 * kMiB);            // at most the ring
  CHECK(plan::ring_pages(0, 1 << 20) == 0);                                // no rings
  CHECK(plan::shm_segment_pages(512 << 10, 2, 10.0 * kMiB) == 3 * kMiB);   // 3 buffer sets x 2 ranks x 512 KiB
  CHECK(plan::shm_segment_pages(512 << 10, 2, 1.0 * kMiB) == kMiB);        // as far as the largest op reaches
  CHECK(plan::shm_segment_pages(512 << 10, 1, 10.0 * kMiB) == 0);
  plan::HostMemory host;
  host.process_overhead_bytes = 3 * kMiB;
  host.keeps_freed_memory = true;
  plan::MemoryBreakdown memory;
  memory.add("parameters", 8.0 * kMiB);
  plan::add_host_lines(memory, host, 4.0 * kMiB);  // 4 MiB of the heap's small blocks kept
  CHECK(memory.tensor_bytes() == 8 * kMiB);
  CHECK(memory.total() == 15 * kMiB);
  CHECK_THAT(memory.render(), Contains("heap's small blocks (measured)") && Contains("resident only") &&
                                  Contains("resident set"));
  host.keeps_freed_memory = false;  // glibc's defaults: its retention is not predicted
  plan::MemoryBreakdown defaults;
  plan::add_host_lines(defaults, host, 4.0 * kMiB);
  CHECK(defaults.total() == 3 * kMiB);
  host.keeps_freed_memory = true;

  // A 2-stage pipeline on one host: each rank maps its ring to the other and the other's to it.
  auto net = network(0, 0);
  net.host_memory.stage_ring_bytes = 16 * kMiB;
  plan::Configuration pipe;
  pipe.strategy = plan::Strategy::Pipeline;
  pipe.world = 2;
  pipe.schedule = torchpar::pipeline::ScheduleKind::GPipe;
  pipe.microbatches = 2;
  const auto p = plan::predict(equal_layers(2, 2 * kMiB), net, batch_of(8), pipe);
  CHECK(p.tensor_memory_per_rank == 8 * kMiB + 800 + 200);
  CHECK(p.memory_per_rank - p.tensor_memory_per_rank == 2 * plan::ring_pages(16 * kMiB, 2 * 200));
  // DDP beside an shm group: its segment's pages as far as its largest bucket (a layer, 2 MiB) reaches, the
  // model's measured heap retention (a rank re-making all its gradients keeps all of it: 5 MiB), the process's 3 MiB,
  // and the last layer's backward temporaries (1 MiB at 8 samples: 0.5 MiB at a rank's 4) as tensors, beside
  // every layer's activations (its backward runs first, before any activation is freed).
  auto model = equal_layers(2, 2 * kMiB);
  model.heap_retention_bytes = 5 * kMiB;
  model.layers[1].backward_temporary_bytes = kMiB;
  net.host_memory = host;
  net.host_memory.shm_chunk_bytes = 512 << 10;
  net.host_memory.stage_ring_bytes = 16 * kMiB;
  plan::Configuration ddp;
  ddp.world = 2;
  const auto d = plan::predict(model, net, batch_of(8), ddp);
  CHECK(d.tensor_memory_per_rank == 16 * kMiB + 800 + kMiB / 2);
  CHECK(d.memory_per_rank - d.tensor_memory_per_rank == 2 * kMiB + 5 * kMiB + 3 * kMiB);
  // A 2-stage pipeline's rank re-makes half the gradients: half the retention, 2.5 MiB.
  const auto half = plan::predict(model, net, batch_of(8), pipe);
  CHECK(half.memory_per_rank - half.tensor_memory_per_rank ==
        2 * plan::ring_pages(16 * kMiB, 2 * 200) + 5 * kMiB / 2 + 3 * kMiB);
  // The first layer's temporaries come when the second's activations are freed: only what exceeds them counts.
  model.layers[1].backward_temporary_bytes = 0;
  model.layers[0].backward_temporary_bytes = kMiB + 2 * 400;
  CHECK(plan::predict(model, net, batch_of(8), ddp).tensor_memory_per_rank == 16 * kMiB + 800 + kMiB / 2);
  model.layers[0].backward_temporary_bytes = 2 * 400;  // no more than the freed activations: nothing on top
  CHECK(plan::predict(model, net, batch_of(8), ddp).tensor_memory_per_rank == 16 * kMiB + 800);
}
