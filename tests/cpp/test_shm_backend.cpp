// The shm backend from C++: torchpar::init_process_group("shm") on forked ranks.
#include <dirent.h>

#include <chrono>
#include <set>
#include <string>
#include <thread>

#include "catch_with_torch.h"
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torchpar/comm/shm/shm_work.h>

#include "harness.h"

using torchpar::testing::RankOptions;
using torchpar::testing::run_on_ranks;
using Catch::Matchers::Contains;

namespace {

RankOptions shm() {
  RankOptions options;
  options.backend = "shm";
  options.collective_timeout = std::chrono::seconds(30);
  return options;
}

std::set<std::string> our_segments() {
  std::set<std::string> names;
  if (DIR* directory = ::opendir("/dev/shm")) {
    while (dirent* entry = ::readdir(directory)) {
      if (std::string(entry->d_name).rfind("torchpar-", 0) == 0) {
        names.insert(entry->d_name);
      }
    }
    ::closedir(directory);
  }
  return names;
}

// Segments that appeared since `before` and are still there. Tests run in parallel (ctest -j), so
// another test's group may hold a name for the few milliseconds until its ranks have mapped it; a
// leaked name never goes away, so waiting a few seconds for the others tells the two apart.
std::set<std::string> leaked_since(const std::set<std::string>& before) {
  std::set<std::string> appeared;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  do {
    appeared.clear();
    for (const auto& name : our_segments()) {
      if (before.count(name) == 0) {
        appeared.insert(name);
      }
    }
    if (appeared.empty()) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } while (std::chrono::steady_clock::now() < deadline);
  return appeared;
}

} // namespace

TEST_CASE("shm: allreduce, broadcast and allgather are exact, small and chunked", "[shm]") {
  const auto before = our_segments();
  const int world = GENERATE(1, 2, 3, 4);
  run_on_ranks(world, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    REQUIRE(pg->getBackend(c10::DeviceType::CPU)->getBackendName() == "shm");
    CHECK(pg->getBackendName() == "shm");  // c10d's own group would say "custom"
    const uint64_t issued_before = pg->getBackend(c10::DeviceType::CPU)->getSequenceNumberForGroup();
    for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{4099}, int64_t{3} * (1 << 20) + 17}) {
      std::vector<at::Tensor> sum{at::arange(numel, at::kDouble).remainder(97) + rank};
      pg->allreduce(sum)->wait();
      const auto expected = at::arange(numel, at::kDouble).remainder(97) * world + world * (world - 1) / 2.0;
      CHECK(at::allclose(sum[0], expected, 0, 0));

      std::vector<at::Tensor> shared{rank == 0 ? at::arange(numel, at::kInt) : at::zeros({numel}, at::kInt)};
      pg->broadcast(shared)->wait();
      CHECK(at::allclose(shared[0], at::arange(numel, at::kInt), 0, 0));

      std::vector<std::vector<at::Tensor>> gathered(1);
      for (int r = 0; r < world; ++r) {
        gathered[0].push_back(at::empty({numel}, at::kFloat));
      }
      std::vector<at::Tensor> mine{at::full({numel}, static_cast<double>(rank), at::kFloat)};
      pg->allgather(gathered, mine)->wait();
      for (int r = 0; r < world; ++r) {
        CHECK(at::allclose(gathered[0][r], at::full({numel}, static_cast<double>(r), at::kFloat), 0, 0));
      }
    }
    // Three collectives for each of the four sizes: the group's sequence number, equal on every rank.
    CHECK(pg->getBackend(c10::DeviceType::CPU)->getSequenceNumberForGroup() == issued_before + 12);
  }, shm());
  CHECK(leaked_since(before).empty());
}

TEST_CASE("shm: different calls on different ranks are an error on every rank, then the group goes on",
          "[shm]") {
  run_on_ranks(3, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    std::vector<at::Tensor> uneven{at::ones({rank == 2 ? 9 : 8})};
    CHECK_THROWS_WITH(pg->allreduce(uneven)->wait(),
                      Contains("different collectives") && Contains("allreduce of float32, 36 bytes"));
    std::vector<at::Tensor> fine{at::ones({8})};
    pg->allreduce(fine)->wait();
    CHECK(at::allclose(fine[0], at::full({8}, static_cast<double>(world)), 0, 0));
  }, shm());
}

TEST_CASE("shm: an op's result is refused until it completed, as Gloo does", "[shm]") {
  const auto output = at::arange(4);
  torchpar::comm::shm::ShmWork done(1, c10d::OpType::ALLREDUCE, 7, {output});
  CHECK_THROWS_WITH(done.result(), Contains("Work needs to be completed before calling result()") &&
                                       Contains("ALLREDUCE on rank 1"));
  done.complete();
  const auto results = done.result();
  REQUIRE(results.size() == 1);
  CHECK(results[0].is_same(output));

  torchpar::comm::shm::ShmWork failed(1, c10d::OpType::ALLREDUCE, 8, {output});
  failed.fail(std::make_exception_ptr(std::runtime_error("the peer left")));
  CHECK_THROWS_WITH(failed.wait(), Contains("the peer left"));
}

// A small op runs on its caller's thread and wakes the backend's thread only when another op was queued
// meanwhile: here rank 0's second op, issued from another thread while its first waits for rank 1.
TEST_CASE("shm: an op issued while another runs on its caller's thread runs once that one finishes", "[shm]") {
  run_on_ranks(2, [](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    std::vector<at::Tensor> first{at::full({256}, static_cast<double>(rank + 1))};
    std::vector<at::Tensor> second{at::full({256}, 10.0 * (rank + 1))};
    c10::intrusive_ptr<c10d::Work> first_work;
    c10::intrusive_ptr<c10d::Work> second_work;
    if (rank == 0) {
      auto* backend = pg->getBackend(c10::DeviceType::CPU).get();
      const uint64_t issued_before = backend->getSequenceNumberForGroup();
      std::thread later([&] {
        // Once the first op was issued (it then waits for rank 1, 300 ms from the start).
        while (backend->getSequenceNumberForGroup() == issued_before) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        second_work = pg->allreduce(second);
      });
      first_work = pg->allreduce(first);  // returns once rank 1 joined
      later.join();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      first_work = pg->allreduce(first);
      second_work = pg->allreduce(second);
    }
    first_work->wait(std::chrono::seconds(10));
    second_work->wait(std::chrono::seconds(10));
    CHECK(at::allclose(first[0], at::full({256}, 3.0), 0, 0));
    CHECK(at::allclose(second[0], at::full({256}, 30.0), 0, 0));
  }, shm());
}

TEST_CASE("shm: unsupported requests name the op", "[shm]") {
  run_on_ranks(2, [](int rank, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    std::vector<at::Tensor> booleans{at::ones({4}, at::kBool)};
    CHECK_THROWS_WITH(pg->allreduce(booleans, c10d::AllreduceOptions{c10d::ReduceOp::AVG}),
                      Contains("allreduce with ReduceOp.AVG needs a numeric tensor, got Bool"));
    std::vector<at::Tensor> float8{at::ones({4}).to(at::kFloat8_e4m3fn)};
    CHECK_THROWS_WITH(pg->allreduce(float8), Contains("allreduce cannot reduce tensors of dtype Float8_e4m3fn"));
    std::vector<at::Tensor> rows{at::ones({4, 3})};
    std::vector<at::Tensor> other_rows{at::ones({6, 2})};
    std::vector<int64_t> no_splits;
    CHECK_THROWS_WITH(pg->alltoall_base(other_rows[0], rows[0], no_splits, no_splits),
                      Contains("alltoall needs input and output rows of one shape"));
    std::vector<at::Tensor> two{at::ones({4}), at::ones({4})};
    CHECK_THROWS_WITH(pg->allreduce(two), Contains("allreduce takes exactly one tensor per rank, got 2"));
    // The element count is not enough: a transposed output would receive the values in another layout.
    std::vector<at::Tensor> input{at::ones({2, 3})};
    std::vector<std::vector<at::Tensor>> transposed{{at::empty({3, 2}), at::empty({3, 2})}};
    CHECK_THROWS_WITH(pg->allgather(transposed, input),
                      Contains("every output tensor must have the input's dtype and shape (Float [2, 3]), got Float [3, 2]"));
  }, shm());
}
