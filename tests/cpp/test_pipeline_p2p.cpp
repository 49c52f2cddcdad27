// pipeline/p2p: activations forward and gradients backward between two stages' ranks (2 forked ranks,
// Gloo and shm, through the same-host rings and through the group), including shapes that change between
// micro-batches and integer tensors.
#include "catch_with_torch.h"
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>

#include <torchpar/pipeline/p2p.h>

#include "harness.h"

#include <cstdlib>

namespace pipeline = torchpar::pipeline;
using torchpar::testing::RankOptions;
using torchpar::testing::run_on_ranks;

namespace {

// Micro-batch m's activations: [rows(m), 3] floats and [rows(m)] int64 ids; rows change at m = 2 and 3
// (a variable sequence length) and stay for the others, so the guessed shapes hit and miss.
int64_t rows(int microbatch) { return microbatch < 2 ? 4 : (microbatch == 2 ? 7 : 5); }

pipeline::Tensors activations(int microbatch) {
  return {at::arange(rows(microbatch) * 3, at::kFloat).view({rows(microbatch), 3}) + 100 * microbatch,
          at::arange(rows(microbatch), at::kLong) * (microbatch + 1)};
}

at::Tensor gradient(int microbatch) { return at::full({rows(microbatch), 3}, 0.5 * microbatch); }

} // namespace

TEST_CASE("pipeline p2p: activations and gradients arrive exact, with shapes changing between micro-batches",
          "[pipeline]") {
  RankOptions options;
  options.backend = GENERATE(std::string("gloo"), std::string("shm"));
  const bool rings = GENERATE(true, false);  // through the same-host rings, or the group's send/recv
  INFO(options.backend << (rings ? ", rings" : ", no rings"));
  constexpr int kMicrobatches = 5;
  constexpr int kStage = 1;  // the receiving stage, on rank 1
  run_on_ranks(2, [rings](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    ::setenv("TORCHPAR_PIPELINE_RING_BYTES", rings ? "1048576" : "0", 1);  // this forked rank's own environment
    for (int step = 0; step < 2; ++step) {  // the second step starts from the first one's shapes
      pipeline::StageLinks links(pg, c10::Device(c10::kCPU));
      REQUIRE(links.through_rings(1 - rank) == rings);
      if (rank == 0) {
        // Sends never block: all micro-batches go out before any gradient is waited for.
        for (int m = 0; m < kMicrobatches; ++m) links.send_activations(activations(m), kStage, m, 1);
        for (int m = 0; m < kMicrobatches; ++m) {
          auto pending = links.post_gradients(pipeline::metas_of(activations(m)), kStage, m, 1);
          const auto grads = links.wait(pending);
          REQUIRE(grads.size() == 2);
          CHECK(at::equal(grads[0], gradient(m)));
          CHECK_FALSE(grads[1].defined());  // int64 ids carry no gradient
        }
      } else {
        for (int m = 0; m < kMicrobatches; ++m) {
          links.post_activations(kStage, m, 0);
          const auto received = links.receive_activations(kStage, m);
          REQUIRE(received.size() == 2);
          CHECK(at::equal(received[0], activations(m)[0]));
          CHECK(at::equal(received[1], activations(m)[1]));
          CHECK(received[1].scalar_type() == at::kLong);
          links.send_gradients({gradient(m), at::Tensor()}, pipeline::metas_of(received), kStage, m, 0);
        }
      }
      links.wait_sends();
      pg->barrier()->wait();
    }
  }, options);
}

TEST_CASE("pipeline p2p: tensor descriptions read as a user writes them", "[pipeline]") {
  const auto metas = pipeline::metas_of({at::ones({8, 16}), at::ones({8}, at::kLong)});
  CHECK(pipeline::describe(metas) == "[8, 16] Float, [8] Long");
  CHECK(pipeline::carries_gradient(metas[0]));
  CHECK_FALSE(pipeline::carries_gradient(metas[1]));
}
