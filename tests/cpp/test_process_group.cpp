#include <cstdlib>
#include <thread>

#include "catch_with_torch.h"
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torchpar/comm/process_group.h>

#include "harness.h"

using torchpar::testing::run_on_ranks;
using Catch::Matchers::Contains;

namespace {

// Rank r's contribution: [r*L, r*L+1, ..., r*L+L-1] with L = 5, in double so sums are exact.
at::Tensor contribution(int rank) {
  return at::arange(5, at::kDouble) + rank * 5;
}

} // namespace

TEST_CASE("all_reduce, broadcast, all_gather and send/recv give exact results on gloo", "[process_group]") {
  const int world = GENERATE(2, 3, 4);
  run_on_ranks(world, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    REQUIRE(pg->getRank() == rank);
    REQUIRE(pg->getSize() == world);

    std::vector<at::Tensor> sum{contribution(rank)};
    pg->allreduce(sum)->wait();
    at::Tensor expected = at::zeros({5}, at::kDouble);
    for (int r = 0; r < world; ++r) {
      expected += contribution(r);
    }
    CHECK(at::allclose(sum[0], expected, 0, 0));

    std::vector<at::Tensor> maximum{at::full({3}, static_cast<double>(rank), at::kDouble)};
    pg->allreduce(maximum, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
    CHECK(at::allclose(maximum[0], at::full({3}, world - 1.0, at::kDouble), 0, 0));

    const int root = world - 1;
    std::vector<at::Tensor> broadcast{rank == root ? contribution(rank) : at::zeros({5}, at::kDouble)};
    c10d::BroadcastOptions broadcast_options;
    broadcast_options.rootRank = root;
    pg->broadcast(broadcast, broadcast_options)->wait();
    CHECK(at::allclose(broadcast[0], contribution(root), 0, 0));

    std::vector<std::vector<at::Tensor>> gathered(1);
    for (int r = 0; r < world; ++r) {
      gathered[0].push_back(at::zeros({5}, at::kDouble));
    }
    std::vector<at::Tensor> mine{contribution(rank)};
    pg->allgather(gathered, mine)->wait();
    for (int r = 0; r < world; ++r) {
      CHECK(at::allclose(gathered[0][r], contribution(r), 0, 0));
    }

    // A ring: send to the right, receive from the left.
    std::vector<at::Tensor> outgoing{contribution(rank)};
    std::vector<at::Tensor> incoming{at::zeros({5}, at::kDouble)};
    auto sent = pg->send(outgoing, (rank + 1) % world, /*tag=*/7);
    pg->recv(incoming, (rank + world - 1) % world, /*tag=*/7)->wait();
    sent->wait();
    CHECK(at::allclose(incoming[0], contribution((rank + world - 1) % world), 0, 0));
  });
}

TEST_CASE("shm_group_beside: an shm group over a same-host Gloo group's ranks, none across hosts or when turned off",
          "[process_group]") {
  run_on_ranks(3, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    REQUIRE(pg->getBackendName() == "gloo");
    CHECK(torchpar::comm::shm_group_fits_beside(pg));
    for (int made = 0; made < 2; ++made) {  // a second group beside the same one gets a name of its own
      const auto beside = torchpar::shm_group_beside(pg);
      REQUIRE(beside);
      CHECK(beside->getBackendName() == "shm");
      CHECK((beside->getRank() == rank && beside->getSize() == world));
      CHECK(beside->getGroupName() == "torchpar_shm_beside_" + pg->getGroupName() + "_" + std::to_string(made));
      std::vector<at::Tensor> sum{contribution(rank)};
      beside->allreduce(sum)->wait();
      at::Tensor expected = at::zeros({5}, at::kDouble);
      for (int r = 0; r < world; ++r) expected += contribution(r);
      CHECK(at::allclose(sum[0], expected, 0, 0));
    }
    CHECK_FALSE(torchpar::shm_group_beside(torchpar::shm_group_beside(pg)));  // not beside an shm group
    setenv("TORCHPAR_DDP_SAME_HOST", "0", 1);
    CHECK_FALSE(torchpar::comm::shm_group_fits_beside(pg));
    CHECK_FALSE(torchpar::shm_group_beside(pg));
    unsetenv("TORCHPAR_DDP_SAME_HOST");
    // Ranks that say they are on different hosts (as tests simulate several): no group, on every rank.
    setenv("TORCHPAR_HOST_ID", rank == 0 ? "host-a" : "host-b", 1);
    CHECK_FALSE(torchpar::shm_group_beside(pg));
    unsetenv("TORCHPAR_HOST_ID");
  });
}

TEST_CASE("a master that nobody hosts is reported within the timeout, naming the address", "[process_group]") {
  // A port that was free a moment ago and that nobody listens on.
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "9", 1); // the discard port: never served here
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(
      torchpar::init_process_group(torchpar::InitOptions().timeout(std::chrono::seconds(2))),
      Contains("rank 1 could not reach the rendezvous store at 127.0.0.1:9 within 2 s") &&
          Contains("MASTER_ADDR and MASTER_PORT"));
  const auto elapsed = std::chrono::steady_clock::now() - start;
  CHECK(elapsed < std::chrono::seconds(30));
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    unsetenv(name);
  }
}

TEST_CASE("TORCHPAR_TIMEOUT is a whole, finite, positive number of seconds", "[process_group]") {
  const auto timeout_for = [](const char* text) {
    setenv("TORCHPAR_TIMEOUT", text, 1);
    const auto timeout = torchpar::comm::resolve_timeout({});
    unsetenv("TORCHPAR_TIMEOUT");
    return timeout;
  };
  CHECK(timeout_for("2.5") == std::chrono::milliseconds(2500));
  CHECK(timeout_for("90") == std::chrono::seconds(90));
  for (const char* text : {"500ms", "5s", "2 ", "soon", "", "nan", "inf", "-inf", "0", "-1", "1e300"}) {
    CAPTURE(text);
    CHECK_THROWS_WITH(timeout_for(text), Contains(std::string("TORCHPAR_TIMEOUT='") + text +
                                                  "' is not a positive number of seconds") &&
                                             Contains("TORCHPAR_TIMEOUT=0.5 for 500 ms"));
    unsetenv("TORCHPAR_TIMEOUT");
  }
}

TEST_CASE("new_group names an unreadable LOCAL_RANK and its value", "[process_group]") {
  auto world = torchpar::init_process_group(
      torchpar::InitOptions().rank(0).world_size(1).store(c10::make_intrusive<c10d::HashStore>()));
  for (const char* text : {"abc", "1x"}) {
    CAPTURE(text);
    setenv("LOCAL_RANK", text, 1);
    CHECK_THROWS_AS(torchpar::new_group(world, {0}), torchpar::LaunchError);
    CHECK_THROWS_WITH(torchpar::new_group(world, {0}),
                      Contains(std::string("torchpar.new_group: LOCAL_RANK='") + text + "' is not an integer"));
    unsetenv("LOCAL_RANK");
  }
}

TEST_CASE("nccl all_reduce on CUDA tensors, one rank per GPU", "[process_group][cuda]") {
  const int devices = static_cast<int>(at::detail::getCUDAHooks().deviceCount());
  if (devices == 0) {
    WARN("no GPU on this machine: the NCCL collective test is skipped (the NCCL paths were compiled)");
    return;
  }
  const int world = std::min(devices, 2);
  torchpar::testing::RankOptions options;
  options.backend = "cpu:gloo,cuda:nccl";
  run_on_ranks(world, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    std::vector<at::Tensor> sum{contribution(rank).to(at::Device(at::kCUDA, rank))};
    pg->allreduce(sum)->wait();
    at::Tensor expected = at::zeros({5}, at::kDouble);
    for (int r = 0; r < world; ++r) {
      expected += contribution(r);
    }
    CHECK(at::allclose(sum[0].cpu(), expected, 0, 0));
  }, options);
}
