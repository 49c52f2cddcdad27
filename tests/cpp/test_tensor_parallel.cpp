// tensor_parallel from C++: the layers and the vocabulary-parallel loss on forked ranks against
// torch::nn's single-process layers (float64), the 3-D grid's groups, a layer refused for ranks seeded
// differently and the loss's options. The Python suite (tests/python/test_tensor_parallel*.py) covers
// sizes 1-4 and every option.
#include "catch_with_torch.h"
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DefaultDtype.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <torchpar/tensor_parallel/cross_entropy.h>
#include <torchpar/tensor_parallel/layer_norm.h>
#include <torchpar/tensor_parallel/layers.h>
#include <torchpar/tensor_parallel/parallel_grid.h>
#include <torchpar/tensor_parallel/sharded_parameters.h>

#include <cmath>


#include "harness.h"

namespace tp = torchpar::tensor_parallel;
using torchpar::testing::RankOptions;
using torchpar::testing::run_on_ranks;

namespace {

at::Tensor shard(const at::Tensor& full, int64_t dim, int rank, int world) { return full.chunk(world, dim)[rank]; }

bool close(const at::Tensor& a, const at::Tensor& b) { return at::allclose(a, b, 1e-10, 1e-10); }

} // namespace

TEST_CASE("tensor parallel: a column-row MLP, an embedding and the vocabulary-parallel loss equal torch::nn",
          "[tensor_parallel]") {
  RankOptions options;
  options.backend = GENERATE(std::string("gloo"), std::string("shm"));
  run_on_ranks(2, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    c10::set_default_dtype(caffe2::TypeMeta::Make<double>());
    torch::manual_seed(0);
    tp::ColumnParallelLinear up(pg, tp::ColumnParallelLinearOptions(8, 12));
    tp::RowParallelLinear down(pg, tp::RowParallelLinearOptions(12, 6));
    tp::VocabParallelEmbedding embedding(pg, tp::VocabParallelEmbeddingOptions(20, 8));
    torch::manual_seed(0);
    torch::nn::Linear up_ref(8, 12), down_ref(12, 6);
    torch::nn::Embedding embedding_ref(20, 8);

    const auto x = at::randn({5, 8}, at::TensorOptions().dtype(at::kDouble));
    auto x_mine = x.clone().requires_grad_(true);
    auto x_ref = x.clone().requires_grad_(true);
    auto y = down->forward(at::gelu(up->forward(x_mine)));
    auto y_ref = down_ref->forward(at::gelu(up_ref->forward(x_ref)));
    CHECK(close(y, y_ref));
    (y * at::arange(6)).sum().backward();
    (y_ref * at::arange(6)).sum().backward();
    CHECK(close(x_mine.grad(), x_ref.grad()));
    CHECK(close(up->weight.grad(), shard(up_ref->weight.grad(), 0, rank, world)));
    CHECK(close(up->bias.grad(), shard(up_ref->bias.grad(), 0, rank, world)));
    CHECK(close(down->weight.grad(), shard(down_ref->weight.grad(), 1, rank, world)));
    CHECK(close(down->bias.grad(), down_ref->bias.grad()));

    const auto ids = at::randint(0, 20, {4, 3}, at::kLong);
    const auto rows = embedding->forward(ids);
    CHECK(close(rows, embedding_ref->forward(ids)));
    // Logits over a 20-id vocabulary split like the embedding's rows: a loss that never gathers them.
    const auto targets = at::randint(0, 20, {4}, at::kLong);
    auto logits_ref = at::randn({4, 20}, at::TensorOptions().dtype(at::kDouble)).requires_grad_(true);
    auto logits = shard(logits_ref.detach(), 1, rank, world).clone().requires_grad_(true);
    const auto losses = tp::vocab_parallel_cross_entropy(
        logits, targets, pg, tp::VocabParallelCrossEntropyOptions().reduction(torch::kNone));
    const auto losses_ref = at::cross_entropy_loss(logits_ref, targets, {}, at::Reduction::None);
    CHECK(close(losses, losses_ref));
    losses.sum().backward();
    losses_ref.sum().backward();
    CHECK(close(logits.grad(), shard(logits_ref.grad(), 1, rank, world)));
  }, options);
}

TEST_CASE("tensor parallel: a sequence-parallel LayerNorm-MLP region equals torch::nn on the whole sequence",
          "[tensor_parallel]") {
  run_on_ranks(2, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    c10::set_default_dtype(caffe2::TypeMeta::Make<double>());
    torch::manual_seed(0);
    tp::SequenceParallelLayerNorm norm(pg, torch::nn::LayerNormOptions({8}));
    tp::ColumnParallelLinear up(pg, tp::ColumnParallelLinearOptions(8, 12).sequence_parallel(true));
    tp::RowParallelLinear down(pg, tp::RowParallelLinearOptions(12, 8).sequence_parallel(true));
    torch::manual_seed(0);
    torch::nn::LayerNorm norm_ref(torch::nn::LayerNormOptions({8}));
    torch::nn::Linear up_ref(8, 12), down_ref(12, 8);

    // [sequence, batch, features]; each rank holds its half of the sequence.
    const auto x = at::randn({6, 2, 8}, at::TensorOptions().dtype(at::kDouble));
    auto x_mine = shard(x, 0, rank, world).clone().requires_grad_(true);
    auto x_ref = x.clone().requires_grad_(true);
    auto y = down->forward(at::gelu(up->forward(norm->forward(x_mine))));
    auto y_ref = down_ref->forward(at::gelu(up_ref->forward(norm_ref->forward(x_ref))));
    CHECK(close(y, shard(y_ref, 0, rank, world)));
    (y * at::arange(8)).sum().backward();
    (y_ref * at::arange(8)).sum().backward();
    CHECK(close(x_mine.grad(), shard(x_ref.grad(), 0, rank, world)));
    // The replicated parameters' gradients cover the whole sequence, not this rank's half.
    CHECK(close(norm->weight.grad(), norm_ref->weight.grad()));
    CHECK(close(norm->bias.grad(), norm_ref->bias.grad()));
    CHECK(close(down->bias.grad(), down_ref->bias.grad()));
    CHECK(close(up->weight.grad(), shard(up_ref->weight.grad(), 0, rank, world)));
  });
}

TEST_CASE("tensor parallel: a 2 x 1 x 2 grid puts tensor groups innermost", "[tensor_parallel]") {
  run_on_ranks(4, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    torchpar::ParallelGrid grid(pg, 2, 1, 2);
    CHECK(grid.tensor_index() == rank % 2);
    CHECK(grid.data_index() == rank / 2);
    CHECK(grid.describe() == "rank " + std::to_string(rank) + " of 4: data " + std::to_string(rank / 2) +
                                 "/2, pipeline 0/1, tensor " + std::to_string(rank % 2) + "/2");
    auto members = [&](const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
      std::vector<at::Tensor> mine{at::zeros({world})};
      mine[0][rank] = 1;
      group->allreduce(mine)->wait();
      return mine[0].nonzero().flatten();
    };
    CHECK(at::equal(members(grid.tensor_group()), at::arange(rank / 2 * 2, rank / 2 * 2 + 2)));
    CHECK(at::equal(members(grid.data_group()), at::arange(rank % 2, 4, 2)));
    CHECK(members(grid.pipeline_group()).numel() == 1);
  });
}

TEST_CASE("tensor parallel: a module's full state_dict and gradient norm are the single-process model's",
          "[tensor_parallel]") {
  run_on_ranks(2, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    c10::set_default_dtype(caffe2::TypeMeta::Make<double>());
    torch::manual_seed(0);
    // One statement each: the order of a call's arguments is unspecified, the order of draws is not.
    tp::ColumnParallelLinear column(pg, tp::ColumnParallelLinearOptions(4, 6));
    torch::nn::LayerNorm norm(torch::nn::LayerNormOptions({3}));
    tp::RowParallelLinear row(pg, tp::RowParallelLinearOptions(6, 2));
    torch::nn::Sequential model(column, norm, row);
    torch::manual_seed(0);
    torch::nn::Linear first(4, 6), second(6, 2);

    const auto layouts = tp::parameter_layouts(*model);
    REQUIRE(layouts.size() == 6);
    CHECK(layouts[0].name == "0.weight");
    CHECK(layouts[0].split_dim == 0);
    CHECK(layouts[1].split_dim == 0);   // the column layer's bias is split too
    CHECK(layouts[2].split_dim == -1);  // LayerNorm: replicated
    CHECK(layouts[4].split_dim == 1);   // the row layer's weight
    CHECK(layouts[5].split_dim == -1);  // its bias: replicated

    const auto full = tp::full_state_dict(*model, pg);
    CHECK(close(full["0.weight"], first->weight));
    CHECK(close(full["2.weight"], second->weight));
    CHECK(close(full["2.bias"], second->bias));
    {
      torch::NoGradGuard no_grad;
      for (auto& parameter : model->parameters()) parameter.fill_(3);
    }
    tp::load_full_state_dict(*model, full, pg);
    CHECK(close(layouts[0].parameter, shard(first->weight, 0, rank, world)));
    CHECK(close(layouts[4].parameter, shard(second->weight, 1, rank, world)));

    // Gradients 1 on shards, 2 on replicated parameters: the norm counts each shard once per rank of
    // the group and each replicated value once.
    int64_t sharded = 0, replicated = 0;
    for (const auto& layout : layouts) {
      layout.parameter.mutable_grad() = at::full_like(layout.parameter, layout.split_dim >= 0 ? 1.0 : 2.0);
      (layout.split_dim >= 0 ? sharded : replicated) += layout.parameter.numel();
    }
    const double expected = std::sqrt(static_cast<double>(sharded * world + 4 * replicated));
    CHECK(std::abs(tp::clip_grad_norm(layouts, 1.0, pg) - expected) < 1e-9);
    CHECK(std::abs(layouts[0].parameter.grad()[0][0].item<double>() - 1.0 / (expected + 1e-6)) < 1e-12);
  });
}

TEST_CASE("tensor parallel: ranks seeded differently are refused and the loss takes the options of torch",
          "[tensor_parallel]") {
  run_on_ranks(2, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    c10::set_default_dtype(caffe2::TypeMeta::Make<double>());
    torch::manual_seed(rank);
    REQUIRE_THROWS_WITH(tp::RowParallelLinear(pg, tp::RowParallelLinearOptions(4, 2).name("blocks.0.down")),
                        Catch::Matchers::Contains("blocks.0.down: the ranks of the tensor-parallel group built different "
                                        "initial values of the layer (weight, bias): rank 1 drew") &&
                            Catch::Matchers::Contains("torch::manual_seed(0)"));

    // ignore_index, label_smoothing and the mean over the targets not ignored, against torch.
    torch::manual_seed(0);
    const auto targets = at::arange(6, at::kLong).mul_(3).remainder_(8);  // 0 3 6 1 4 7; 3 is ignored
    auto logits_ref = at::randn({6, 8}, at::TensorOptions().dtype(at::kDouble)).requires_grad_(true);
    auto logits = shard(logits_ref.detach(), 1, rank, world).clone().requires_grad_(true);
    const auto loss = tp::vocab_parallel_cross_entropy(
        logits, targets, pg, tp::VocabParallelCrossEntropyOptions().ignore_index(3).label_smoothing(0.1));
    const auto loss_ref = at::cross_entropy_loss(logits_ref, targets, {}, at::Reduction::Mean, 3, 0.1);
    CHECK(close(loss, loss_ref));
    loss.backward();
    loss_ref.backward();
    CHECK(close(logits.grad(), shard(logits_ref.grad(), 1, rank, world)));
  });
}
