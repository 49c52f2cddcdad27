// comm/shm/communicator: the shm backend's collectives engine, its ranks as threads of this process
// over one segment (the backend's ranks are processes: test_shm_backend.cpp). Small chunks make every
// op run in many rounds, so the double-buffered rounds and partitioned reductions are exercised.
#include "catch_with_torch.h"
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <torchpar/comm/shm/communicator.h>
#include <torchpar/common/error_message.h>

#include <unistd.h>

#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <thread>

using namespace torchpar::comm::shm;
using Catch::Matchers::Contains;

namespace {

OpDescriptor descriptor(OpKind kind, const at::Tensor& tensor, int64_t root = -1,
                        c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM) {
  OpDescriptor d{};
  d.op = static_cast<uint32_t>(kind);
  d.dtype = static_cast<int32_t>(tensor.scalar_type());
  d.root = root;
  d.reduce_op = static_cast<uint32_t>(op);
  d.agreed_bytes = tensor.nbytes();
  return d;
}

// A group of `world` communicators over one fresh segment, unlinked at once (the threads map it first).
std::vector<std::unique_ptr<Communicator>> group(int world, size_t chunk_bytes, std::chrono::milliseconds timeout) {
  const SegmentLayout layout{world, chunk_bytes};
  std::random_device random;
  const std::string name = "/torchpar-test-" + std::to_string(::getpid()) + "-" + std::to_string(random());
  std::vector<std::unique_ptr<Communicator>> ranks;
  ranks.push_back(std::make_unique<Communicator>(SharedSegment::create(name, layout.total_bytes()), layout, 0, timeout));
  for (int rank = 1; rank < world; ++rank) {
    ranks.push_back(std::make_unique<Communicator>(SharedSegment::open(name, layout.total_bytes()), layout, rank, timeout));
  }
  SharedSegment::unlink(name);
  return ranks;
}

// Runs body(rank) on one thread per rank; rethrows nothing, returns each rank's error text ("" if none).
std::vector<std::string> on_threads(int world, const std::function<void(int)>& body) {
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (const std::exception& error) {
        errors[rank] = torchpar::message_of(error);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return errors;
}

} // namespace

TEST_CASE("shm communicator: reductions equal the sum over ranks, whole, at the root and scattered", "[shm]") {
  const int world = GENERATE(2, 3);
  // 4 KiB chunks: the 1.2 MiB tensors go in many rounds, the 2 KiB ones in one ("one-shot").
  auto ranks = group(world, 4096, std::chrono::seconds(30));
  for (int64_t numel : {int64_t{86} * world, int64_t{51201} * world}) {
    const auto expected = at::arange(numel, at::kDouble) * world + world * (world - 1) / 2.0;
    const auto errors = on_threads(world, [&](int rank) {
      auto& comm = *ranks[rank];
      const auto input = at::arange(numel, at::kDouble) + rank;
      auto all = at::empty_like(input);
      comm.reduce(descriptor(OpKind::Allreduce, input), input, all, ReduceMode::All, c10d::ReduceOp::SUM);
      TORCH_CHECK(at::allclose(all, expected, 0, 0), "allreduce differs on rank ", rank);

      auto at_root = at::zeros_like(input);
      comm.reduce(descriptor(OpKind::Reduce, input, 1), input, at_root, ReduceMode::Root, c10d::ReduceOp::SUM);
      if (rank == 1) TORCH_CHECK(at::allclose(at_root, expected, 0, 0), "reduce differs at the root");

      auto block = at::empty({numel / world}, at::kDouble);
      comm.reduce(descriptor(OpKind::ReduceScatter, input), input, block, ReduceMode::Scatter, c10d::ReduceOp::SUM);
      TORCH_CHECK(at::allclose(block, expected.chunk(world)[rank], 0, 0), "reduce_scatter differs on rank ", rank);

      const auto ones = at::full({numel}, 2.0 + rank, at::kFloat);
      auto largest = at::empty_like(ones);
      comm.reduce(descriptor(OpKind::Allreduce, ones, -1, c10d::ReduceOp::MAX), ones, largest, ReduceMode::All,
                  c10d::ReduceOp::MAX);
      TORCH_CHECK(at::allclose(largest, at::full({numel}, 1.0 + world, at::kFloat), 0, 0), "max differs");

      // In place: a rank reads the part only it reduces from its input, not from its slot, and the
      // output may be that input (all-reduce, reduce) or a view of it (reduce_scatter into its block).
      auto in_place = input.clone();
      comm.reduce(descriptor(OpKind::Allreduce, in_place), in_place, in_place, ReduceMode::All, c10d::ReduceOp::SUM);
      TORCH_CHECK(at::allclose(in_place, expected, 0, 0), "in-place allreduce differs on rank ", rank);
      in_place = input.clone();
      comm.reduce(descriptor(OpKind::Reduce, in_place, 0), in_place, in_place, ReduceMode::Root, c10d::ReduceOp::SUM);
      TORCH_CHECK(at::allclose(in_place, rank == 0 ? expected : input, 0, 0), "in-place reduce differs on rank ", rank);
      in_place = input.clone();
      auto own_block = in_place.chunk(world)[rank];
      comm.reduce(descriptor(OpKind::ReduceScatter, in_place), in_place, own_block, ReduceMode::Scatter,
                  c10d::ReduceOp::SUM);
      TORCH_CHECK(at::allclose(own_block, expected.chunk(world)[rank], 0, 0), "in-place reduce_scatter differs");
    });
    for (int rank = 0; rank < world; ++rank) {
      INFO("numel " << numel << ", rank " << rank);
      CHECK(errors[rank] == "");
    }
  }
}

TEST_CASE("shm communicator: an all-reduce of tensors where they lie, each rank's split differently", "[shm]") {
  const int world = GENERATE(2, 3);
  // 4 KiB chunks; the pieces' boundaries fall inside partitions, chunks and the one-shot size alike.
  auto ranks = group(world, 4096, std::chrono::seconds(30));
  for (int64_t numel : {int64_t{300}, int64_t{5000} * world + 17}) {
    const auto expected = at::arange(numel, at::kFloat) * world + world * (world - 1) / 2.0;
    const auto errors = on_threads(world, [&](int rank) {
      // Rank r cuts the logical tensor every 37 * (r + 1) elements, into separate allocations.
      std::vector<at::Tensor> tensors;
      std::vector<std::pair<char*, uint64_t>> pieces;
      const auto whole = at::arange(numel, at::kFloat) + rank;
      for (int64_t first = 0; first < numel; first += 37 * (rank + 1)) {
        tensors.push_back(whole.slice(0, first, std::min(numel, first + 37 * (rank + 1))).clone());
        pieces.emplace_back(static_cast<char*>(tensors.back().data_ptr()), tensors.back().nbytes());
      }
      const Pieces in_place(pieces);
      ranks[rank]->reduce(descriptor(OpKind::Allreduce, whole), in_place, in_place, at::kFloat, ReduceMode::All,
                          c10d::ReduceOp::SUM);
      TORCH_CHECK(at::equal(at::cat(tensors), expected), "all-reduce of pieces differs on rank ", rank);

      // From pieces into one tensor, and a reduce_scatter from pieces: input and output split apart.
      std::vector<std::pair<char*, uint64_t>> input_pieces;
      int64_t first = 0;
      for (auto& tensor : tensors) {
        tensor.copy_(whole.slice(0, first, first + tensor.numel()));
        first += tensor.numel();
        input_pieces.emplace_back(static_cast<char*>(tensor.data_ptr()), tensor.nbytes());
      }
      auto all = at::empty({numel}, at::kFloat);
      ranks[rank]->reduce(descriptor(OpKind::Allreduce, all), Pieces(input_pieces),
                          Pieces(static_cast<char*>(all.data_ptr()), all.nbytes()), at::kFloat, ReduceMode::All,
                          c10d::ReduceOp::SUM);
      TORCH_CHECK(at::equal(all, expected), "all-reduce of pieces into one tensor differs on rank ", rank);
      const int64_t block_numel = numel / world;
      auto block = at::empty({block_numel}, at::kFloat);
      ranks[rank]->reduce(descriptor(OpKind::ReduceScatter, all), Pieces(input_pieces), Pieces(static_cast<char*>(block.data_ptr()), block.nbytes()),
                          at::kFloat, ReduceMode::Scatter, c10d::ReduceOp::SUM);
      TORCH_CHECK(at::equal(block, expected.slice(0, rank * block_numel, (rank + 1) * block_numel)),
                  "reduce_scatter of pieces differs on rank ", rank);
    });
    for (int rank = 0; rank < world; ++rank) {
      INFO("numel " << numel << ", rank " << rank);
      CHECK(errors[rank] == "");
    }
  }
}

TEST_CASE("shm communicator: back-to-back all-reduces of many rounds, ranks out of step, every result exact",
          "[shm]") {
  // A rank copies round k's reduced partitions during round k + 1: a slot must not be refilled before
  // the slowest rank copied from it. More ranks than cores, and one that sometimes pauses, spread the
  // ranks over several rounds.
  const int world = 3;
  auto ranks = group(world, 4096, std::chrono::seconds(5));
  // 10 rounds of 4 KiB, then a shorter one, whose partitions are not the others' (a rank publishes
  // where it had reduced the round before).
  const int64_t numel = 1024 * 10 + 700;
  const auto errors = on_threads(world, [&](int rank) {
    std::mt19937 pauses(rank);
    for (int op = 0; op < 200; ++op) {
      auto tensor = at::arange(numel, at::kFloat) * (rank + 1) + op;
      ranks[rank]->reduce(descriptor(OpKind::Allreduce, tensor), tensor, tensor, ReduceMode::All, c10d::ReduceOp::SUM);
      const auto expected = at::arange(numel, at::kFloat) * (world * (world + 1) / 2) + world * op;
      TORCH_CHECK(at::equal(tensor, expected), "all-reduce ", op, " differs on rank ", rank);
      if (rank == 1 && pauses() % 8 == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(pauses() % 300));
      }
    }
  });
  for (int rank = 0; rank < world; ++rank) {
    INFO("rank " << rank);
    CHECK(errors[rank] == "");
  }
}

TEST_CASE("shm communicator: exchange delivers uneven streams, any slice of any rank's", "[shm]") {
  const int world = 3;
  auto ranks = group(world, 1024, std::chrono::seconds(30));
  // Rank r contributes (r + 1) * 3000 bytes of value r + 1; everyone takes all of every stream.
  const auto errors = on_threads(world, [&](int rank) {
    std::vector<char> stream(static_cast<size_t>(rank + 1) * 3000, static_cast<char>(rank + 1));
    std::vector<std::vector<char>> received(world);
    std::vector<Want> wants;
    for (int source = 0; source < world; ++source) {
      received[source].assign(static_cast<size_t>(source + 1) * 3000 - 7, 0);
      wants.push_back({source, 7, received[source].size(), received[source].data()});
    }
    OpDescriptor d{};
    d.op = static_cast<uint32_t>(OpKind::AllToAll);
    d.agreed_bytes = 0;
    ranks[rank]->exchange(d, stream.data(), stream.size(), wants);
    for (int source = 0; source < world; ++source) {
      for (char byte : received[source]) {
        TORCH_CHECK(byte == static_cast<char>(source + 1), "rank ", rank, " got a wrong byte from rank ", source);
      }
    }
  });
  for (const auto& error : errors) CHECK(error.empty());
}

TEST_CASE("shm communicator: different calls are an error on every rank, and the next op works", "[shm]") {
  const int world = 2;
  auto ranks = group(world, 4096, std::chrono::seconds(30));
  const auto errors = on_threads(world, [&](int rank) {
    const auto input = at::ones({rank == 0 ? 8 : 9});
    auto output = at::empty_like(input);
    ranks[rank]->reduce(descriptor(OpKind::Allreduce, input), input, output, ReduceMode::All, c10d::ReduceOp::SUM);
  });
  for (const auto& error : errors) {
    CHECK_THAT(error, Contains("different collectives") && Contains("allreduce of float32, 32 bytes") &&
                          Contains("allreduce of float32, 36 bytes"));
  }
  const auto after = on_threads(world, [&](int rank) {
    const auto input = at::ones({8});
    auto output = at::empty_like(input);
    ranks[rank]->reduce(descriptor(OpKind::Allreduce, input), input, output, ReduceMode::All, c10d::ReduceOp::SUM);
    TORCH_CHECK(at::allclose(output, at::full({8}, 2.0)), "sum after a mismatch is wrong");
  });
  for (const auto& error : after) CHECK(error.empty());
}

TEST_CASE("shm communicator: a rank that never comes times the others out, and the group is then unusable",
          "[shm]") {
  const int world = 3;
  auto ranks = group(world, 4096, std::chrono::milliseconds(300));
  const auto errors = on_threads(world, [&](int rank) {
    if (rank == 2) return;  // never joins the op
    const auto input = at::ones({8});
    auto output = at::empty_like(input);
    ranks[rank]->reduce(descriptor(OpKind::Allreduce, input), input, output, ReduceMode::All, c10d::ReduceOp::SUM);
  });
  for (int rank = 0; rank < 2; ++rank) {
    CHECK_THAT(errors[rank], Contains("allreduce #1 on rank " + std::to_string(rank)) &&
                                 Contains("Timed out waiting for rank(s) 2"));
  }
  const auto input = at::ones({8});
  auto output = at::empty_like(input);
  CHECK_THROWS_WITH(
      ranks[0]->reduce(descriptor(OpKind::Allreduce, input), input, output, ReduceMode::All, c10d::ReduceOp::SUM),
      Contains("the group is unusable since an earlier op failed"));
}
