// torchpar::ps from C++ on forked ranks: LibTorch modules trained through the servers (RemoteParameters +
// Embedding) against single-process training of the same global batch (the wire format and request
// checks: test_ps_messages.cpp; the tables and optimizers: test_ps_tables.cpp).
#include "catch_with_torch.h"
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/randint.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <torchpar/ps/embedding.h>
#include <torchpar/ps/remote_parameters.h>
#include <torchpar/ps/service.h>

#include "harness.h"

namespace ps = torchpar::ps;
using torchpar::testing::run_on_ranks;

TEST_CASE("LibTorch modules trained through the servers under BSP equal single-process SGD") {
  constexpr int kWorkers = 2;
  constexpr int kSteps = 4;
  constexpr int64_t kRows = 50;
  constexpr int64_t kDim = 4;
  constexpr int64_t kBatch = 6; // per worker
  constexpr double kLr = 0.5;
  // Global batches: ids [steps, workers * batch, 3] (duplicates on purpose), labels [steps, workers * batch].
  torch::manual_seed(7);
  const auto ids = at::randint(0, 12, {kSteps, kWorkers * kBatch, 3}, at::kLong);
  const auto labels = at::randint(0, 3, {kSteps, kWorkers * kBatch}, at::kLong);
  const auto initializer = ps::RowInitializer::uniform(-0.5, 0.5, 11);

  auto forward = [](const at::Tensor& rows, torch::nn::Linear& head, const at::Tensor& y) {
    return at::cross_entropy_loss(head->forward(rows.sum(1)), y);
  };

  run_on_ranks(kWorkers + 1, [&](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    ps::ParameterService service(pg, ps::ServiceOptions().num_servers(1).timeout(std::chrono::seconds(30)));
    if (service.is_server()) {
      service.serve();
      return;
    }
    auto& client = service.client();
    torch::manual_seed(1);
    torch::nn::Linear head(kDim, 3);
    ps::RemoteParameters parameters(client, head->named_parameters(), ps::OptimizerConfig::sgd(kLr), "head.");
    ps::Embedding embedding(client, "rows", kRows, kDim, ps::OptimizerConfig::sgd(kLr), initializer);
    const auto all_ids = at::arange(kRows, at::kLong);
    // The reference starts from the same values: the table's initial rows and worker 0's head.
    auto initial_rows = client.pull_rows({embedding->table()}, {all_ids});
    initial_rows->waitAndThrow();
    const auto start_rows = initial_rows->value().toTensorList().get(0).clone();

    for (int step = 0; step < kSteps; ++step) {
      const auto mine = at::indexing::Slice(rank * kBatch, (rank + 1) * kBatch);
      auto loss = forward(embedding->forward(ids[step].index({mine})), head, labels[step].index({mine}));
      loss.backward();
      embedding->flush();
      parameters.step();
    }
    embedding->flush();
    auto final_rows = client.pull_rows({embedding->table()}, {all_ids});
    final_rows->waitAndThrow();
    const auto rows = final_rows->value().toTensorList().get(0);

    torch::manual_seed(1);
    torch::nn::Linear reference_head(kDim, 3);
    torch::nn::Embedding reference_embedding(kRows, kDim);
    {
      torch::NoGradGuard no_grad;
      reference_embedding->weight.copy_(start_rows);
    }
    auto reference_parameters = reference_head->parameters();
    reference_parameters.push_back(reference_embedding->weight);
    torch::optim::SGD sgd(reference_parameters, torch::optim::SGDOptions(kLr));
    for (int step = 0; step < kSteps; ++step) {
      sgd.zero_grad();
      forward(reference_embedding->forward(ids[step]), reference_head, labels[step]).backward();
      sgd.step();
    }
    CHECK(at::allclose(rows, reference_embedding->weight.detach(), 1e-5, 1e-5));
    CHECK(at::allclose(head->weight.detach(), reference_head->weight.detach(), 1e-5, 1e-5));
    CHECK(at::allclose(head->bias.detach(), reference_head->bias.detach(), 1e-5, 1e-5));
    CHECK_FALSE(at::allclose(rows, start_rows)); // it did train
    service.finish();
  });
}

TEST_CASE("RemoteParameters pushes each bucket during backward, before step(), and keeps frozen parameters local") {
  run_on_ranks(2, [&](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    ps::ParameterService service(pg, ps::ServiceOptions().num_servers(1).timeout(std::chrono::seconds(30)));
    if (service.is_server()) {
      service.serve();
      return;
    }
    torch::manual_seed(3);
    torch::nn::Linear first(4, 8);
    torch::nn::Linear second(8, 2);
    second->bias.requires_grad_(false);
    torch::OrderedDict<std::string, at::Tensor> named;
    for (const auto& item : first->named_parameters()) named.insert("first." + item.key(), item.value());
    for (const auto& item : second->named_parameters()) named.insert("second." + item.key(), item.value());
    // A cap of one byte: every parameter is its own bucket, pushed the moment its gradient is final.
    ps::RemoteParameters parameters(service.client(), named, ps::OptimizerConfig::sgd(0.1), "", 1);
    CHECK(parameters.buckets() == std::vector<std::vector<std::string>>{
                                      {"second.weight"}, {"first.bias"}, {"first.weight"}});
    const auto frozen_bias = second->bias.detach().clone();
    const auto x = at::ones({5, 4});
    for (int step = 1; step <= 2; ++step) {
      second->forward(at::relu(first->forward(x))).sum().backward();
      CHECK(parameters.clock() == step);  // every table was pushed by backward itself
      parameters.step();
      CHECK(parameters.clock() == step);
      CHECK_FALSE(first->weight.grad().defined());
    }
    CHECK(at::equal(second->bias.detach(), frozen_bias));

    parameters.remove_hooks();
    second->forward(at::relu(first->forward(x))).sum().backward();
    CHECK(parameters.clock() == 2);  // without hooks nothing goes out before step()
    parameters.step();
    CHECK(parameters.clock() == 3);
    service.finish();
  });
}
