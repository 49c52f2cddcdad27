// torchpar::sharded from C++: the shard layout alone, then ShardedDataParallel around a LibTorch module on
// forked ranks against single-process training of the same global batch (stages 1, 2 and 3, Adam).
#include "catch_with_torch.h"
#include <cstdlib>
#include <filesystem>
#include <string>
#include <tuple>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/tanh.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <torchpar/sharded/sharded_data_parallel.h>

#include "harness.h"

using torchpar::sharded::build_shard_layout;
using torchpar::sharded::ShardedDataParallel;
using torchpar::sharded::ShardedOptions;
using torchpar::testing::run_on_ranks;

TEST_CASE("sharded layout: buckets in backward order, padded to the group, one piece per rank", "[sharded]") {
  // 4 float parameters of 5, 7, 3 and 6 elements, buckets of at least 40 bytes (10 floats), 4 ranks.
  const auto layout = build_shard_layout({5, 7, 3, 6}, std::vector<c10::ScalarType>(4, c10::kFloat), {3, 2, 1, 0},
                                         {40}, 4);
  REQUIRE(layout.buckets.size() == 2);
  const auto& first = layout.buckets[0];  // parameters 3 and 2, then 1 closes it at 16 elements
  CHECK(first.slots.size() == 3);
  CHECK(first.slots[0].parameter == 3);
  CHECK(first.slots[2].offset == 9);
  CHECK(first.padded_numel == 16);
  CHECK(first.piece_numel == 4);
  const auto& second = layout.buckets[1];  // parameter 0 alone: 5 elements padded to 8
  CHECK(second.padded_numel == 8);
  CHECK(second.piece_numel == 2);
  CHECK(second.shard_offset == 4);
  REQUIRE(layout.shards.size() == 1);
  CHECK(layout.shards[0].second == 6);
  CHECK(layout.location[1] == std::make_pair(size_t{0}, size_t{2}));
  CHECK(layout.reduce_scatter_bytes() == (16 + 8) / 4 * 3 * 4);
  // A small first cap, as DDP's: parameter 3 (24 bytes) closes the first bucket, then 2 and 1 fill a 40-byte one.
  const auto early = build_shard_layout({5, 7, 3, 6}, std::vector<c10::ScalarType>(4, c10::kFloat), {3, 2, 1, 0},
                                        {12, 40}, 4);
  REQUIRE(early.buckets.size() == 3);
  CHECK(early.buckets[0].slots.size() == 1);
  CHECK(early.buckets[0].slots[0].parameter == 3);
  CHECK(early.buckets[1].slots.size() == 2);
  CHECK(early.buckets[2].slots[0].parameter == 0);
}

TEST_CASE("sharded layout: every rank's pieces cover each parameter once, where its shard holds them", "[sharded]") {
  // The layout of the first test: bucket 0 = parameters 3 (6), 2 (3), 1 (7), padded to 16; bucket 1 = parameter 0 (5)
  // padded to 8; 4 ranks, pieces of 4 and 2.
  const auto layout = build_shard_layout({5, 7, 3, 6}, std::vector<c10::ScalarType>(4, c10::kFloat), {3, 2, 1, 0},
                                         {40}, 4);
  std::vector<std::vector<int>> covered = {std::vector<int>(5), std::vector<int>(7), std::vector<int>(3),
                                           std::vector<int>(6)};
  for (int rank = 0; rank < 4; ++rank) {
    for (const auto& piece : torchpar::sharded::pieces_of(layout, 0, rank)) {
      CHECK(piece.shard_offset + piece.numel <= layout.shards[0].second);
      for (int64_t i = 0; i < piece.numel; ++i) ++covered[piece.parameter][piece.parameter_offset + i];
    }
  }
  for (const auto& parameter : covered) {
    for (int times : parameter) CHECK(times == 1);
  }
  // Rank 2's piece of bucket 0 is its elements 8..11: parameter 2's last element, then parameter 1's first three;
  // of bucket 1, elements 4..5: parameter 0's last (5 is padding), at offset 4 of its shard.
  const auto pieces = torchpar::sharded::pieces_of(layout, 0, 2);
  REQUIRE(pieces.size() == 3);
  CHECK((pieces[0].parameter == 2 && pieces[0].parameter_offset == 2 && pieces[0].shard_offset == 0 &&
         pieces[0].numel == 1));
  CHECK((pieces[1].parameter == 1 && pieces[1].parameter_offset == 0 && pieces[1].shard_offset == 1 &&
         pieces[1].numel == 3));
  CHECK((pieces[2].parameter == 0 && pieces[2].parameter_offset == 4 && pieces[2].shard_offset == 4 &&
         pieces[2].numel == 1));
  CHECK(torchpar::sharded::pieces_of(layout, 0, 3).size() == 1);  // its piece of bucket 1 is all padding
  CHECK_THROWS_WITH(torchpar::sharded::pieces_of(layout, 0, 4), Catch::Contains("no rank 4"));
}

TEST_CASE("sharded layout: dtypes never share a bucket, each has its shard", "[sharded]") {
  const auto layout = build_shard_layout({4, 4, 4}, {c10::kFloat, c10::kDouble, c10::kFloat}, {0, 1, 2}, {1 << 20}, 3);
  REQUIRE(layout.buckets.size() == 2);
  REQUIRE(layout.shards.size() == 2);
  CHECK(layout.shards[layout.shard_index(c10::kFloat)].second == 3);   // 8 elements padded to 9, 3 per rank
  CHECK(layout.shards[layout.shard_index(c10::kDouble)].second == 2);  // 4 padded to 6
}

TEST_CASE("sharded layout: stage 3's units are buckets, in backward order, split by dtype", "[sharded]") {
  using torchpar::sharded::build_unit_layout;
  // Units: 0 (the root) holds parameter 0, unit 1 parameters 1 and 2 (float, double), unit 2 parameter 3.
  const auto layout = build_unit_layout({3, 4, 5, 6}, {c10::kFloat, c10::kFloat, c10::kDouble, c10::kFloat},
                                        {0, 1, 1, 2}, 3, 2);
  REQUIRE(layout.buckets.size() == 4);
  CHECK(layout.buckets[0].unit == 2);
  CHECK(layout.buckets[1].unit == 1);
  CHECK(layout.buckets[2].unit == 1);
  CHECK(layout.buckets[1].dtype != layout.buckets[2].dtype);
  CHECK(layout.buckets[3].unit == 0);
  CHECK(layout.buckets[3].padded_numel == 4);  // 3 elements padded for 2 ranks
  CHECK_THROWS_WITH(build_unit_layout({3}, {c10::kFloat}, {5}, 3, 2), Catch::Matchers::Contains("in unit 5 of 3"));
}

namespace {

torch::nn::Sequential network() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(5, 7), torch::nn::Tanh(), torch::nn::Linear(7, 3));
}

void check_same_values(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("parameter " << i);
    CHECK(at::allclose(got[i], want[i], 1e-5, 1e-6));
  }
}

void check_same_parameters(torch::nn::Sequential& ours, torch::nn::Sequential& expected, int stage) {
  INFO("stage " << stage);
  check_same_values(ours->parameters(), expected->parameters());
}

} // namespace

TEST_CASE("sharded: stages 1, 2 and 3 train a LibTorch module as one process does on the global batch", "[sharded]") {
  run_on_ranks(3, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    constexpr int kPerRank = 2, kSteps = 3;
    torch::manual_seed(11);
    std::vector<std::pair<at::Tensor, at::Tensor>> batches;
    for (int step = 0; step < kSteps; ++step) batches.emplace_back(at::randn({world * kPerRank, 5}), at::randn({world * kPerRank, 3}));
    auto reference = network();
    torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(0.01));
    for (const auto& [x, y] : batches) {
      reference_optimizer.zero_grad();
      at::mse_loss(reference->forward(x), y).backward();
      reference_optimizer.step();
    }
    for (int stage : {1, 2, 3}) {
      // Stage 3's units by default: the Sequential's children that hold parameters, its two Linear layers.
      auto options = ShardedOptions().process_group(pg).stage(stage);
      if (stage < 3) options.bucket_cap_mb(0.0001);
      ShardedDataParallel sharded(network(), options);
      auto optimizer = sharded.optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01));
      for (const auto& [x, y] : batches) {
        optimizer.zero_grad();
        const auto output = sharded(x.narrow(0, rank * kPerRank, kPerRank));
        if (stage == 3) {
          // Gathered one unit at a time and freed after its forward: the autograd graph's views hold nothing.
          for (const auto& parameter : sharded.module()->parameters()) CHECK(parameter.storage().nbytes() == 0);
        }
        at::mse_loss(output, y.narrow(0, rank * kPerRank, kPerRank)).backward();
        optimizer.step();
      }
      if (stage == 3) {
        for (const auto& parameter : sharded.module()->parameters()) {
          CHECK(parameter.storage().nbytes() == 0);  // between steps a rank holds only its shard
        }
        sharded.unshard();
      }
      check_same_parameters(sharded.module(), reference, stage);
    }
  });
}

namespace {

// Not a Sequential: two blocks registered as Units and a head left in the root, with a probe of what is gathered
// while the second block runs.
struct TwoBlocksImpl : torch::nn::Module {
  TwoBlocksImpl() {
    torch::manual_seed(3);
    block0 = register_module("block0", torchpar::sharded::Unit(torch::nn::AnyModule(torch::nn::Linear(5, 6))));
    block1 = register_module("block1", torchpar::sharded::Unit(torch::nn::AnyModule(torch::nn::Linear(6, 4))));
    head = register_module("head", torch::nn::Linear(4, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto hidden = at::tanh(block0(x));
    block0_bytes_after_its_forward = block0->parameters()[0].storage().nbytes();
    return head(at::tanh(block1(hidden)));
  }
  torchpar::sharded::Unit block0{nullptr}, block1{nullptr};
  torch::nn::Linear head{nullptr};
  size_t block0_bytes_after_its_forward = 0;
};
TORCH_MODULE(TwoBlocks);

} // namespace

TEST_CASE("sharded: Unit modules in any LibTorch module are stage 3's units, each gathered only around its passes",
          "[sharded]") {
  run_on_ranks(2, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    constexpr int kPerRank = 3;
    torch::manual_seed(17);
    std::vector<std::pair<at::Tensor, at::Tensor>> batches;
    for (int step = 0; step < 3; ++step) batches.emplace_back(at::randn({world * kPerRank, 5}), at::randn({world * kPerRank, 3}));
    TwoBlocks reference;
    torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(0.01));
    for (const auto& [x, y] : batches) {
      reference_optimizer.zero_grad();
      at::mse_loss(reference->forward(x), y).backward();
      reference_optimizer.step();
    }
    CHECK(reference->block0_bytes_after_its_forward > 0);  // outside a wrapper a Unit is its module
    ShardedDataParallel sharded(TwoBlocks(), ShardedOptions().process_group(pg).stage(3));
    CHECK(sharded.coordinator().unit_names() == std::vector<std::string>{"block0", "block1"});
    auto optimizer = sharded.optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01));
    for (const auto& [x, y] : batches) {
      optimizer.zero_grad();
      const auto output = sharded(x.narrow(0, rank * kPerRank, kPerRank));
      CHECK(sharded.module()->block0_bytes_after_its_forward == 0);  // freed before block1 ran
      CHECK(sharded.module()->block1->parameters()[0].storage().nbytes() == 0);
      CHECK(sharded.module()->head->weight.storage().nbytes() > 0);  // the root stays gathered through backward
      at::mse_loss(output, y.narrow(0, rank * kPerRank, kPerRank)).backward();
      optimizer.step();
    }
    sharded.unshard();
    check_same_values(sharded.module()->parameters(), reference->parameters());
  });
}

namespace {

// A block of two tensors in and two out: what a Unit's call() wraps.
struct GatedImpl : torch::nn::Module {
  GatedImpl() {
    value = register_module("value", torch::nn::Linear(5, 6));
    skip = register_module("skip", torch::nn::Linear(5, 6));
  }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& gate) {
    return {value(x) * gate, skip(x)};
  }
  torch::nn::Linear value{nullptr}, skip{nullptr};
};
TORCH_MODULE(Gated);

struct GatedNetImpl : torch::nn::Module {
  GatedNetImpl() {
    torch::manual_seed(4);
    stem = register_module("stem", torch::nn::Linear(5, 5));
    block = register_module("block", torchpar::sharded::Unit(torch::nn::AnyModule(Gated())));
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    // The block's inputs need gradients, so its backward reads its weights: they must be gathered again by then.
    const auto hidden = at::tanh(stem(x));
    auto [gated, skipped] =
        block->call<std::tuple<at::Tensor, at::Tensor>>(hidden, at::sigmoid(hidden.narrow(1, 0, 1)));
    block_bytes_after_its_forward = block->parameters()[0].storage().nbytes();
    return head(at::tanh(gated) + at::tanh(skipped));
  }
  torchpar::sharded::Unit block{nullptr};
  torch::nn::Linear stem{nullptr}, head{nullptr};
  size_t block_bytes_after_its_forward = 0;
};
TORCH_MODULE(GatedNet);

} // namespace

TEST_CASE("sharded: a Unit's call() takes and returns several tensors, each output's gradient gathering it again",
          "[sharded]") {
  run_on_ranks(2, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    constexpr int kPerRank = 3;
    torch::manual_seed(19);
    std::vector<std::pair<at::Tensor, at::Tensor>> batches;
    for (int step = 0; step < 3; ++step) batches.emplace_back(at::randn({world * kPerRank, 5}), at::randn({world * kPerRank, 3}));
    GatedNet reference;
    torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(0.01));
    for (const auto& [x, y] : batches) {
      reference_optimizer.zero_grad();
      at::mse_loss(reference->forward(x), y).backward();
      reference_optimizer.step();
    }
    ShardedDataParallel sharded(GatedNet(), ShardedOptions().process_group(pg).stage(3));
    CHECK(sharded.coordinator().unit_names() == std::vector<std::string>{"block"});
    auto optimizer = sharded.optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01));
    for (const auto& [x, y] : batches) {
      optimizer.zero_grad();
      const auto output = sharded(x.narrow(0, rank * kPerRank, kPerRank));
      CHECK(sharded.module()->block_bytes_after_its_forward == 0);  // released after its forward
      at::mse_loss(output, y.narrow(0, rank * kPerRank, kPerRank)).backward();
      optimizer.step();
    }
    sharded.unshard();
    check_same_values(sharded.module()->parameters(), reference->parameters());
  });
}

TEST_CASE("sharded: gradients of a backward run outside the wrapper are reduced by reduce_gradients", "[sharded]") {
  // As a pipeline stage's micro-batches: the module's own forward and backward, twice, then one reduction.
  run_on_ranks(2, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    torch::manual_seed(5);
    const auto x = at::randn({4 * world, 5}), y = at::randn({4 * world, 3});
    auto reference = network();
    torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(0.01));
    at::mse_loss(reference->forward(x), y).backward();
    reference_optimizer.step();
    for (int stage : {1, 2}) {
      ShardedDataParallel sharded(network(), ShardedOptions().process_group(pg).stage(stage));
      auto optimizer = sharded.optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01));
      for (int half : {0, 1}) {
        const auto rows = x.narrow(0, rank * 4 + 2 * half, 2);
        (at::mse_loss(sharded.module()->forward(rows), y.narrow(0, rank * 4 + 2 * half, 2)) / 2).backward();
      }
      sharded.reduce_gradients();
      optimizer.step();
      check_same_parameters(sharded.module(), reference, stage);
    }
    ShardedDataParallel stage3(network(), ShardedOptions().process_group(pg).stage(3));
    CHECK_THROWS_WITH(stage3.reduce_gradients(), Catch::Matchers::Contains("for stages 1 and 2"));
  });
}

TEST_CASE("sharded: a checkpoint of 3 ranks at stage 3 resumes on 2 at stage 2 and in a bare model, nothing gathered",
          "[sharded]") {
  char name[] = "/tmp/torchpar-sharded-checkpoint-XXXXXX";
  REQUIRE(mkdtemp(name) != nullptr);
  const std::string directory = name;
  // 6 samples a step (2 per rank on 3, 3 on 2); the first layer's bias frozen, so saved whole.
  const auto model = [] {
    auto net = network();
    net[0]->as<torch::nn::Linear>()->bias.set_requires_grad(false);
    return net;
  };
  const auto batches = [] {
    torch::manual_seed(21);
    std::vector<std::pair<at::Tensor, at::Tensor>> steps;
    for (int step = 0; step < 3; ++step) steps.emplace_back(at::randn({6, 5}), at::randn({6, 3}));
    return steps;
  };
  const auto train = [](auto& sharded, auto& optimizer, const std::pair<at::Tensor, at::Tensor>& batch, int rank,
                        int world) {
    const int64_t share = 6 / world;
    optimizer.zero_grad();
    at::mse_loss(sharded(batch.first.narrow(0, rank * share, share)), batch.second.narrow(0, rank * share, share))
        .backward();
    optimizer.step();
  };
  run_on_ranks(3, [&](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    ShardedDataParallel sharded(model(), ShardedOptions().process_group(pg).stage(3));
    auto optimizer = sharded.optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01));
    const auto steps = batches();
    train(sharded, optimizer, steps[0], rank, world);
    train(sharded, optimizer, steps[1], rank, world);
    sharded.save_checkpoint(directory, optimizer);
  });
  // Uninterrupted, in one process: three steps on the whole batches.
  auto reference = model();
  torch::optim::Adam reference_optimizer(reference->parameters(), torch::optim::AdamOptions(0.01));
  for (const auto& [x, y] : batches()) {
    reference_optimizer.zero_grad();
    at::mse_loss(reference->forward(x), y).backward();
    reference_optimizer.step();
  }
  // What takes the checkpoint: a model of other values, an optimizer with no state yet and another learning rate.
  const auto fresh = [] {
    torch::manual_seed(99);
    auto net = torch::nn::Sequential(torch::nn::Linear(5, 7), torch::nn::Tanh(), torch::nn::Linear(7, 3));
    net[0]->as<torch::nn::Linear>()->bias.set_requires_grad(false);
    return net;
  };
  run_on_ranks(2, [&](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    ShardedDataParallel sharded(fresh(), ShardedOptions().process_group(pg).stage(2).bucket_cap_mb(0.0001));
    auto optimizer = sharded.optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.5));
    sharded.load_checkpoint(directory, optimizer);
    CHECK(optimizer.inner().param_groups()[0].options().get_lr() == 0.01);
    train(sharded, optimizer, batches()[2], rank, world);
    check_same_parameters(sharded.module(), reference, 2);
  });
  // And a bare LibTorch model and Adam in this process.
  auto bare = fresh();
  torch::optim::Adam bare_optimizer(bare->parameters(), torch::optim::AdamOptions(0.5));
  torchpar::sharded::load_sharded_checkpoint(directory, *bare, bare_optimizer);
  CHECK(bare_optimizer.param_groups()[0].options().get_lr() == 0.01);
  bare_optimizer.zero_grad();
  at::mse_loss(bare->forward(batches()[2].first), batches()[2].second).backward();
  bare_optimizer.step();
  check_same_values(bare->parameters(), reference->parameters());
  // Another model's parameter sizes are refused (the message names the first found), smaller or larger.
  for (const int64_t hidden : {6, 8}) {
    auto other = torch::nn::Sequential(torch::nn::Linear(5, hidden), torch::nn::Tanh(), torch::nn::Linear(hidden, 3));
    other[0]->as<torch::nn::Linear>()->bias.set_requires_grad(false);
    torch::optim::Adam other_optimizer(other->parameters(), torch::optim::AdamOptions(0.01));
    CHECK_THROWS_WITH(torchpar::sharded::load_sharded_checkpoint(directory, *other, other_optimizer),
                      Catch::Matchers::Contains("elements in the checkpoint") &&
                          Catch::Matchers::Contains("saved from another model?"));
  }
  std::filesystem::remove(std::filesystem::path(directory) / "rank-1-of-3.pt");
  run_on_ranks(2, [&](int, int, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    ShardedDataParallel sharded(model(), ShardedOptions().process_group(pg).stage(2));
    auto optimizer = sharded.optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.01));
    CHECK_THROWS_WITH(sharded.load_checkpoint(directory, optimizer),
                      Catch::Matchers::Contains("a checkpoint of 3 ranks without rank 1's file"));
  });
  std::filesystem::remove_all(directory);
}
