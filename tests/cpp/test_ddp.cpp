// torchpar::ddp from C++: bucket assignment alone, then the DistributedDataParallel module wrapper on
// forked ranks against single-process training of the same global batch.
#include <cmath>

#include "catch_with_torch.h"
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randn.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <sstream>

#include <torchpar/common/bucket_assignment.h>
#include <torch/cuda.h>
#include <torchpar/ddp/comm_hooks.h>
#include <torchpar/ddp/data_parallel.h>
#include <torchpar/ddp/distributed_data_parallel.h>
#include <torchpar/ddp/reducer.h>

#include "harness.h"

using torchpar::assign_buckets;
using torchpar::BucketableParameter;
using torchpar::ddp::DistributedDataParallel;
using torchpar::ddp::DistributedDataParallelOptions;
using torchpar::testing::RankOptions;
using torchpar::testing::run_on_ranks;
using Catch::Matchers::Contains;

namespace {

constexpr int kPerRank = 4;
constexpr int kSteps = 4;

torch::nn::Sequential make_mlp(int hidden = 16) {
  torch::manual_seed(0);
  return torch::nn::Sequential(
      torch::nn::Linear(6, hidden), torch::nn::ReLU(), torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
      torch::nn::Linear(hidden, 3));
}

struct GlobalBatch {
  at::Tensor inputs, targets;
};

std::vector<GlobalBatch> global_batches(int world, int per_rank, int steps) {
  torch::manual_seed(1);
  std::vector<GlobalBatch> batches;
  for (int step = 0; step < steps; ++step) {
    batches.push_back({at::randn({world * per_rank, 6}), at::randn({world * per_rank, 3})});
  }
  return batches;
}

double max_difference(torch::nn::Sequential& a, torch::nn::Sequential& b) {
  double worst = 0;
  auto pa = a->parameters();
  auto pb = b->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>());
  }
  return worst;
}

// One SGD step of single-process training on the whole global batch.
void reference_step(torch::nn::Sequential& model, torch::optim::SGD& optimizer, const GlobalBatch& batch) {
  optimizer.zero_grad();
  at::mse_loss(model->forward(batch.inputs), batch.targets).backward();
  optimizer.step();
}

RankOptions on(const std::string& backend) {
  RankOptions options;
  options.backend = backend;
  options.collective_timeout = std::chrono::seconds(30);
  return options;
}

} // namespace

TEST_CASE("buckets follow reverse registration order, with a small first bucket and one dtype each") {
  const std::vector<BucketableParameter> parameters{
      {400, at::kFloat}, {400, at::kFloat}, {100, at::kHalf}, {400, at::kFloat}, {400, at::kFloat}};
  const auto order = torchpar::reverse_registration_order(parameters.size());
  CHECK(order == std::vector<size_t>{4, 3, 2, 1, 0});
  const auto buckets = assign_buckets(parameters, order, {/*first=*/400, /*then=*/800});
  // 4 fills the small first bucket; 3+1 reach 800; the half-precision parameter 2 has a bucket of its
  // own; 0 is left over.
  REQUIRE(buckets.size() == 4);
  CHECK(buckets[0] == std::vector<size_t>{4});
  CHECK(buckets[1] == std::vector<size_t>{3, 1});
  CHECK(buckets[2] == std::vector<size_t>{2});
  CHECK(buckets[3] == std::vector<size_t>{0});
  CHECK(assign_buckets(parameters, order, {1}).size() == 5);
  // A cap per bucket, the last one serving the rest (bucket_cap_mb_list).
  CHECK(assign_buckets(parameters, order, {400, 400, 1 << 30}) ==
        std::vector<std::vector<size_t>>{{4}, {3}, {2}, {1, 0}});
  CHECK(assign_buckets(parameters, order, {1 << 30}).size() == 2);  // one per dtype
  CHECK_THROWS_WITH(assign_buckets(parameters, {0, 1, 2, 3, 3}, {1}), Contains("not a permutation"));
}

TEST_CASE("C++ DistributedDataParallel trains like one process on the global batch") {
  for (const std::string backend : {"gloo", "shm"}) {
    for (int world : {2, 3}) {
      DYNAMIC_SECTION(backend << " x" << world) {
        run_on_ranks(world, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
          for (bool as_view : {false, true}) {
            auto model = make_mlp();
            auto reference = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
            torch::nn::Sequential reference_model(reference);
            DistributedDataParallel ddp(
                model, DistributedDataParallelOptions().process_group(pg).bucket_cap_mb(1e-4).gradient_as_bucket_view(
                           as_view));
            torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
            torch::optim::SGD reference_optimizer(reference_model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
            for (const auto& batch : global_batches(world, kPerRank, kSteps)) {
              optimizer.zero_grad();
              auto output = ddp(batch.inputs.chunk(world)[rank]);
              at::mse_loss(output, batch.targets.chunk(world)[rank]).backward();
              optimizer.step();
              reference_step(reference_model, reference_optimizer, batch);
            }
            CHECK(ddp.coordinator().reducer().bucket_indices().size() > 1);
            CHECK(max_difference(model, reference_model) < 1e-5);
          }
        }, on(backend));
      }
    }
  }
}

TEST_CASE("C++ DDP keeps averaging after Module::load replaces the parameters' storage (a checkpoint)") {
  run_on_ranks(2, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = make_mlp();
    DistributedDataParallel ddp(model, DistributedDataParallelOptions().process_group(pg));
    // A checkpoint of other weights, loaded after wrapping: LibTorch's load uses set_, which makes
    // autograd replace each parameter's gradient accumulator.
    auto saved = make_mlp();
    for (auto& parameter : saved->parameters()) {
      torch::NoGradGuard no_grad;
      parameter.uniform_(-1, 1);
    }
    torch::serialize::OutputArchive out;
    saved->save(out);
    std::ostringstream bytes;
    out.save_to(bytes);
    const std::string data = bytes.str();
    torch::serialize::InputArchive in;
    in.load_from(data.data(), data.size());
    model->load(in);
    torch::nn::Sequential reference(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone()));
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    torch::optim::SGD reference_optimizer(reference->parameters(), 0.1);
    for (const auto& batch : global_batches(world, kPerRank, kSteps)) {
      optimizer.zero_grad();
      at::mse_loss(ddp(batch.inputs.chunk(world)[rank]), batch.targets.chunk(world)[rank]).backward();
      optimizer.step();
      reference_step(reference, reference_optimizer, batch);
    }
    CHECK(max_difference(model, reference) < 1e-5);
  }, on("gloo"));
}

TEST_CASE("C++ no_sync guard accumulates locally, and the next synchronised backward averages the sum") {
  run_on_ranks(2, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = make_mlp();
    torch::nn::Sequential reference(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone()));
    DistributedDataParallel ddp(model, DistributedDataParallelOptions().process_group(pg));
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    torch::optim::SGD reference_optimizer(reference->parameters(), 0.1);
    for (const auto& batch : global_batches(world, 2 * kPerRank, 2)) {
      optimizer.zero_grad();
      auto inputs = batch.inputs.chunk(world)[rank].chunk(2);
      auto targets = batch.targets.chunk(world)[rank].chunk(2);
      {
        auto guard = ddp.no_sync();
        (at::mse_loss(ddp(inputs[0]), targets[0]) / 2).backward();
      }
      (at::mse_loss(ddp(inputs[1]), targets[1]) / 2).backward();
      optimizer.step();
      reference_step(reference, reference_optimizer, batch);
    }
    CHECK(max_difference(model, reference) < 1e-5);
  });
}

TEST_CASE("C++ join: ranks with fewer batches shadow the others and all end with one model") {
  run_on_ranks(3, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = make_mlp();
    DistributedDataParallel ddp(model, DistributedDataParallelOptions().process_group(pg));
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    const auto batches = global_batches(world, kPerRank, 2 + 2 * world);
    ddp.join([&] {
      for (int step = 0; step < 2 + 2 * rank; ++step) {
        optimizer.zero_grad();
        at::mse_loss(ddp(batches[step].inputs.chunk(world)[rank]), batches[step].targets.chunk(world)[rank])
            .backward();
        optimizer.step();
      }
    });
    for (auto& parameter : model->parameters()) {
      auto gathered = parameter.detach().clone();
      std::vector<at::Tensor> tensors{gathered};
      pg->broadcast(tensors)->wait();  // rank 0's copy
      CHECK(at::equal(gathered, parameter.detach()));
    }
  });
}

TEST_CASE("C++ communication hooks: fp16 compression and a user function") {
  run_on_ranks(2, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    for (const std::string hook : {"fp16", "function"}) {
      auto model = make_mlp();
      torch::nn::Sequential reference(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone()));
      DistributedDataParallel ddp(model, DistributedDataParallelOptions().process_group(pg).bucket_cap_mb(1e-4));
      int calls = 0;
      if (hook == "fp16") {
        ddp.register_comm_hook(torchpar::ddp::fp16_compress_hook(pg));
      } else {
        ddp.register_comm_hook(torchpar::ddp::function_hook([&calls, pg](c10d::GradBucket& bucket) {
          ++calls;
          std::vector<at::Tensor> tensors{bucket.getBufferRef().div_(pg->getSize())};
          return pg->allreduce(tensors)->getFuture();
        }));
      }
      torch::optim::SGD optimizer(model->parameters(), 0.1);
      torch::optim::SGD reference_optimizer(reference->parameters(), 0.1);
      for (const auto& batch : global_batches(world, kPerRank, 3)) {
        optimizer.zero_grad();
        at::mse_loss(ddp(batch.inputs.chunk(world)[rank]), batch.targets.chunk(world)[rank]).backward();
        optimizer.step();
        reference_step(reference, reference_optimizer, batch);
      }
      const double difference = max_difference(model, reference);
      if (hook == "fp16") {
        CHECK(difference < 2e-3);
        CHECK(difference > 0);
      } else {
        CHECK(difference < 1e-5);
        CHECK(calls == 3 * static_cast<int>(ddp.coordinator().reducer().bucket_indices().size()));
      }
    }
  });
}

TEST_CASE("C++ DDP over different models is an error on every rank, naming the parameter and ranks") {
  run_on_ranks(2, [](int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto model = make_mlp(rank == 0 ? 16 : 8);
    CHECK_THROWS_WITH(
        DistributedDataParallel(model, DistributedDataParallelOptions().process_group(pg)),
        Contains("rank 1: parameter 0.weight [8, 6] Float") && Contains("ranks that differ from rank 0: 1"));
  });
}

TEST_CASE("DataParallel without GPUs runs on one device, says why, and computes what the module does") {
  auto model = make_mlp();
  torch::nn::Sequential reference(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone()));
  if (torch::cuda::device_count() > 0) {
    WARN("CUDA devices are visible: the no-GPU fallback is not tested on this machine");
    return;
  }
  torchpar::ddp::DataParallel<torch::nn::Sequential> parallel(model);
  REQUIRE(parallel.devices() == std::vector<c10::Device>{c10::Device(c10::kCPU)});
  CHECK_THAT(parallel.single_device_reason(), Contains("no CUDA device is visible"));
  const auto batch = global_batches(1, 8, 1).front();
  at::mse_loss(parallel(batch.inputs), batch.targets).backward();
  at::mse_loss(reference->forward(batch.inputs), batch.targets).backward();
  for (size_t i = 0; i < model->parameters().size(); ++i) {
    CHECK(at::allclose(model->parameters()[i].grad(), reference->parameters()[i].grad()));
  }
}

TEST_CASE("DataParallel on several CUDA devices matches the module on one", "[cuda]") {
  if (torch::cuda::device_count() < 2) {
    WARN("needs two CUDA devices; this machine has " << static_cast<int>(torch::cuda::device_count()) << ": skipped");
    return;
  }
  auto model = make_mlp();
  torch::nn::Sequential reference(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone()));
  reference->to(c10::Device(c10::kCUDA, 0));
  torchpar::ddp::DataParallel<torch::nn::Sequential> parallel(model);
  CHECK(parallel.single_device_reason().empty());
  const auto batch = global_batches(1, 16, 1).front();
  const auto cuda_inputs = batch.inputs.cuda();
  CHECK(at::allclose(parallel(cuda_inputs), reference->forward(cuda_inputs), 1e-5, 1e-6));
}

TEST_CASE("built-in comm hooks are found by their Python names, and an unknown name lists the known ones") {
  const auto group = c10::make_intrusive<c10d::ProcessGroup>(0, 1); // constructing a hook sends nothing
  for (const char* name : {"allreduce", "fp16", "bf16"}) {
    CHECK(torchpar::ddp::builtin_comm_hook(name, group) != nullptr);
  }
  CHECK_THROWS_WITH(torchpar::ddp::builtin_comm_hook("fp8", group),
                    Catch::Contains("unknown hook 'fp8' (allreduce, fp16, bf16)"));
}
