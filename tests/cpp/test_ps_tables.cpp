// ps/dense_table, ps/sparse_table and ps/optimizer: the servers' tables and their steps against
// torch::optim (in-process).
#include "catch_with_torch.h"
#include <ATen/ops/allclose.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <torchpar/ps/dense_table.h>
#include <torchpar/ps/optimizer.h>
#include <torchpar/ps/sparse_table.h>

namespace ps = torchpar::ps;

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
