// torchpar::ps from C++: the wire format's defences, the dense optimizers against torch::optim, and
// LibTorch modules trained through the servers (RemoteParameters + Embedding) against
// single-process training of the same global batch.
#include <cmath>
#include <cstring>

#include "catch_with_torch.h"
#include <ATen/ops/allclose.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <torchpar/ps/dense_table.h>
#include <torchpar/ps/embedding.h>
#include <torchpar/ps/messages.h>
#include <torchpar/ps/optimizer.h>
#include <torchpar/ps/remote_parameters.h>
#include <torchpar/ps/request_checks.h>
#include <torchpar/ps/service.h>
#include <torchpar/ps/sparse_table.h>

#include "harness.h"

namespace ps = torchpar::ps;
using torchpar::testing::run_on_ranks;
using Catch::Matchers::Contains;

namespace {

std::vector<uint8_t> dense_push_payload(const std::vector<float>& grad) {
  ps::WireWriter writer;
  ps::DenseItem item{0, 0, c10::kFloat, {static_cast<int64_t>(grad.size())}, static_cast<int64_t>(grad.size()),
                     reinterpret_cast<const uint8_t*>(grad.data())};
  ps::encode_dense_items(writer, {item}, /*with_data=*/true);
  return writer.release();
}

} // namespace

TEST_CASE("a request decodes only when every field is there and nothing is left over") {
  const std::vector<float> grad{1, 2, 3, 4, 5};
  const auto payload = dense_push_payload(grad);
  const auto request = ps::decode_request(ps::MessageKind::Push, payload.data(), payload.size());
  REQUIRE(request.dense.size() == 1);
  CHECK(request.dense[0].numel == 5);
  CHECK(request.dense[0].shape == std::vector<int64_t>{5});
  float decoded[5];
  std::memcpy(decoded, request.dense[0].data, sizeof(decoded));
  CHECK(decoded[4] == 5);

  for (size_t cut = 0; cut < payload.size(); ++cut) {
    CHECK_THROWS_WITH(ps::decode_request(ps::MessageKind::Push, payload.data(), cut), Contains("truncated"));
  }
  auto longer = payload;
  longer.push_back(0);
  CHECK_THROWS_WITH(ps::decode_request(ps::MessageKind::Push, longer.data(), longer.size()), Contains("left over"));
  auto bad_dtype = payload;
  bad_dtype[4 + 4 + 8] = 9; // item count, table id, clock, then the dtype code
  CHECK_THROWS_WITH(ps::decode_request(ps::MessageKind::Push, bad_dtype.data(), bad_dtype.size()),
                    Contains("dtype code 9"));
  CHECK_THROWS_WITH(ps::decode_request(static_cast<ps::MessageKind>(77), payload.data(), payload.size()),
                    Contains("unknown request kind 77"));
  int64_t frame[ps::Frame::kFields] = {0, 3, 1, 0};
  CHECK_THROWS_WITH(ps::decode_frame(frame), Contains("magic"));
}

// Each was accepted before, and then made every update of the table throw (the wire fuzzer's first
// finding: an Adam beta1 of -1e300, so that 1 - beta1 overflowed float32), or drew rows outside the
// distributions' preconditions.
TEST_CASE("a registration is refused when its optimizer could not step the table or its initializer draw rows") {
  auto register_sparse = [](const ps::OptimizerConfig& optimizer, const ps::RowInitializer& initializer) {
    ps::WireWriter writer;
    ps::encode_registration(writer, ps::SparseRegistration{"e", c10::kFloat, 10, 4, initializer, optimizer});
    const auto payload = writer.release();
    ps::decode_request(ps::MessageKind::RegisterSparse, payload.data(), payload.size());
  };
  const auto adam = ps::OptimizerConfig::adam(0.01);
  const auto uniform = ps::RowInitializer::uniform(-0.1, 0.1);
  CHECK_NOTHROW(register_sparse(adam, uniform));
  CHECK_NOTHROW(register_sparse(ps::OptimizerConfig::adagrad(0.1), ps::RowInitializer::normal(0, 0.01)));
  CHECK_THROWS_WITH(register_sparse(ps::OptimizerConfig::adam(0.01, -1e300), uniform),
                    Contains("table 'e'") && Contains("beta1 -1e+300 is not in [0, 1)"));
  CHECK_THROWS_WITH(register_sparse(ps::OptimizerConfig::adam(0.01, 0.9, 1.0), uniform), Contains("beta2 1 is not"));
  // lr fits in float32, the first step's lr / (1 - beta1) does not.
  CHECK_THROWS_WITH(register_sparse(ps::OptimizerConfig::adam(1e38, 0.99), uniform),
                    Contains("the first step's size lr / (1 - beta1)") && Contains("(Float)"));
  CHECK_THROWS_WITH(register_sparse(ps::OptimizerConfig::sgd(std::nan("")), uniform), Contains("lr nan is not"));
  CHECK_THROWS_WITH(register_sparse(ps::OptimizerConfig::adagrad(0.1, -1), uniform), Contains("eps -1 is not"));
  CHECK_THROWS_WITH(register_sparse(adam, ps::RowInitializer::uniform(1, -1)),
                    Contains("uniform initializer over [1, -1)"));
  CHECK_THROWS_WITH(register_sparse(adam, ps::RowInitializer::uniform(0, INFINITY)), Contains("uniform initializer"));
  CHECK_THROWS_WITH(register_sparse(adam, ps::RowInitializer::normal(0, -1)), Contains("normal initializer"));
}

TEST_CASE("a learning rate is refused when the table's dtype cannot hold its steps") {
  ps::Tables tables;
  for (auto dtype : {c10::kFloat, c10::kDouble}) {
    tables.push_back(std::make_unique<ps::DenseTable>("w", std::vector<int64_t>{3}, 0, 3, at::zeros({3}, dtype),
                                                      ps::OptimizerConfig::sgd(0.1), 1));
  }
  auto set_learning_rate = [&](uint32_t table, double lr) {
    ps::WireWriter writer;
    ps::encode_learning_rate(writer, table, lr);
    const auto payload = writer.release();
    ps::check_learning_rate(ps::decode_request(ps::MessageKind::SetLearningRate, payload.data(), payload.size()),
                            tables, 0);
  };
  CHECK_NOTHROW(set_learning_rate(0, 0.5));
  CHECK_NOTHROW(set_learning_rate(1, 1e300));
  CHECK_THROWS_WITH(set_learning_rate(0, 1e300), Contains("lr 1e+300 is not in [0, 3.40282e+38] (Float)"));
  CHECK_THROWS_WITH(set_learning_rate(0, -1), Contains("learning rate -1 is negative"));
  CHECK_THROWS_WITH(set_learning_rate(2, 0.1), Contains("unknown table id 2"));
}

// The first touch used to make room for 1024 rows whatever their width: 256 MiB here, 4 GiB (12 with
// Adam's state) for one row at the widest rows a registration allows, from a 235-byte message
// (tests/fuzz/regressions/sparse-wide-row-first-touch).
TEST_CASE("touching one row of a very wide sparse table allocates about that row, not a thousand") {
  ps::SparseTable table("wide", c10::kFloat, 1000, 1 << 16, ps::RowInitializer::zeros(),
                        ps::OptimizerConfig::adagrad(0.1), 1);
  const int64_t id = 7;
  CHECK(table.read_rows(&id, 1).sizes() == at::IntArrayRef{1, 1 << 16});
  CHECK(table.touched_rows() == 1);
  CHECK(table.bytes() <= 2 * (int64_t{1} << 20) + 4096); // values and Adagrad's sums: 4 rows of 256 KiB each
}

TEST_CASE("dense server-side optimizers take torch::optim's steps") {
  torch::manual_seed(3);
  const auto initial = at::randn({11});
  std::vector<at::Tensor> grads;
  for (int step = 0; step < 6; ++step) grads.push_back(at::randn({11}));

  auto check = [&](const ps::OptimizerConfig& config, auto make_reference) {
    auto values = initial.clone();
    auto state = ps::initial_dense_state(config, values);
    auto parameter = initial.clone().requires_grad_(true);
    auto reference = make_reference(std::vector<at::Tensor>{parameter});
    for (const auto& grad : grads) {
      ps::apply_dense(config, values, grad, state);
      parameter.mutable_grad() = grad.clone();
      reference.step();
    }
    CHECK(at::allclose(values, parameter.detach(), 1e-6, 1e-7));
  };
  check(ps::OptimizerConfig::sgd(0.1, 0.9, 0.01), [](std::vector<at::Tensor> p) {
    return torch::optim::SGD(p, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  });
  check(ps::OptimizerConfig::adagrad(0.2, 1e-10, 0.1), [](std::vector<at::Tensor> p) {
    return torch::optim::Adagrad(p, torch::optim::AdagradOptions(0.2).initial_accumulator_value(0.1).eps(1e-10));
  });
  check(ps::OptimizerConfig::adam(0.05, 0.8, 0.99, 1e-6), [](std::vector<at::Tensor> p) {
    return torch::optim::Adam(p, torch::optim::AdamOptions(0.05).betas({0.8, 0.99}).eps(1e-6));
  });
}

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
