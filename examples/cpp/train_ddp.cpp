// Trains an MLP on the 8x8 digits with torchpar's DistributedDataParallel, one replica per rank, each
// rank reading its share of every epoch through LibTorch's DistributedRandomSampler.
//
//   ./scripts/setup.sh                  # also writes data/digits.pt
//   torchrun --nproc-per-node=2 --no-python build/examples/cpp/train_ddp [--data data/digits.pt]
//            [--epochs 20] [--lr 0.1] [--batch-size 32]    (TORCHPAR_BACKEND=shm for shared memory)
//   torchrun --nproc-per-node=2 --max-restarts=3 --no-python build/examples/cpp/train_ddp --checkpoint-dir ckpt
//            [--checkpoint-every 50]     (resumes from the newest complete checkpoint after a failure)
//
// Rank 0 shows per-epoch progress, the held-out accuracy and the fullest rank's peak tensor memory while it
// trains (tensor_peak.h); exit status 1 if the accuracy is below 95%.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <iostream>
#include <optional>
#include <string>

#include <ATen/ops/cross_entropy_loss.h>
#include <c10/util/env.h>
#include <ATen/ops/index_select.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/data/samplers/distributed.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torchpar/torchpar.h>

#include "digits.h"
#include "tensor_peak.h"

namespace {

struct Arguments {
  std::string data = "data/digits.pt";
  int epochs = 20;
  double lr = 0.1;
  size_t batch_size = 32;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 50;
};

Arguments parse(int argc, char** argv) {
  Arguments arguments;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      throw std::invalid_argument("missing value after " + flag);
    }
    const std::string value = argv[++i];
    if (flag == "--data") {
      arguments.data = value;
    } else if (flag == "--epochs") {
      arguments.epochs = std::stoi(value);
    } else if (flag == "--lr") {
      arguments.lr = std::stod(value);
    } else if (flag == "--batch-size") {
      arguments.batch_size = std::stoul(value);
    } else if (flag == "--checkpoint-dir") {
      arguments.checkpoint_dir = value;
    } else if (flag == "--checkpoint-every") {
      arguments.checkpoint_every = std::stoll(value);
    } else {
      throw std::invalid_argument("unknown option " + flag +
                                  " (--data, --epochs, --lr, --batch-size, --checkpoint-dir, --checkpoint-every)");
    }
  }
  return arguments;
}

} // namespace

int main(int argc, char** argv) {
  Arguments arguments;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    arguments = parse(argc, argv);
    group = torchpar::init_process_group();
  } catch (const torchpar::LaunchError& error) {
    std::cerr << "train_ddp: " << error.what() << std::endl;
    return 2;
  } catch (const std::invalid_argument& error) {
    std::cerr << "train_ddp: " << error.what() << std::endl;
    return 2;
  }
  const int rank = group->getRank();
  const int world = group->getSize();
  const auto [train_x, train_y, test_x, test_y] = load_digits(arguments.data);
  const TensorPeak tensor_peak;

  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(64, 128), torch::nn::ReLU(), torch::nn::Linear(128, 10));
  // The two lines that make it data-parallel: wrap the module, then call the wrapper.
  torchpar::ddp::DistributedDataParallel ddp(model, torchpar::ddp::DistributedDataParallelOptions().process_group(group));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(arguments.lr).momentum(0.9));
  // allow_duplicates: every rank gets ceil(N / world) samples, hence the same number of batches.
  torch::data::samplers::DistributedRandomSampler sampler(train_x.size(0), world, rank, /*allow_duplicates=*/true);
  const int64_t samples_per_rank = (train_x.size(0) + world - 1) / world;
  const int64_t batch_size = static_cast<int64_t>(arguments.batch_size);
  const int64_t steps_per_epoch = (samples_per_rank + batch_size - 1) / batch_size;
  const int64_t total = arguments.epochs * steps_per_epoch;

  // Resuming: the newest complete checkpoint's model, optimizer and generators; the data order is a
  // function of the epoch, so the steps already taken are skipped.
  std::optional<torchpar::Checkpointer> checkpoints;
  int64_t done = 0;
  if (!arguments.checkpoint_dir.empty()) {
    checkpoints.emplace(arguments.checkpoint_dir, group);
    if (const auto latest = checkpoints->latest_step()) {
      checkpoints->load(*latest, [&](torch::serialize::InputArchive& archive) {
        torch::serialize::InputArchive model_state;
        torch::serialize::InputArchive optimizer_state;
        archive.read("model", model_state);
        archive.read("optimizer", optimizer_state);
        model->load(model_state);
        optimizer.load(optimizer_state);
        torchpar::load_rng_state(archive);
      });
      done = *latest;
      if (rank == 0) {
        std::cerr << "train_ddp: resumed from the checkpoint of step " << done << " of " << total << " in "
                  << arguments.checkpoint_dir << std::endl;
      }
    }
  }
  auto save = [&](int64_t step) {
    checkpoints->save(step, [&](torch::serialize::OutputArchive& archive) {
      torch::serialize::OutputArchive model_state;
      torch::serialize::OutputArchive optimizer_state;
      model->save(model_state);
      optimizer.save(optimizer_state);
      archive.write("model", model_state);
      archive.write("optimizer", optimizer_state);
      torchpar::save_rng_state(archive);
    });
  };

  int64_t step = 0;
  double step_seconds = 0;  // the steps alone, the data handling aside
  const auto start = std::chrono::steady_clock::now();
  for (int epoch = 0; epoch < arguments.epochs; ++epoch) {
    sampler.set_epoch(epoch);
    sampler.reset();
    double loss_sum = 0;
    int batches = 0;
    while (auto indices = sampler.next(arguments.batch_size)) {
      if (step < done) {
        ++step;
        continue;
      }
      const auto index = at::tensor(std::vector<int64_t>(indices->begin(), indices->end()));
      const auto x = train_x.index_select(0, index);
      const auto y = train_y.index_select(0, index);
      const auto step_start = std::chrono::steady_clock::now();
      optimizer.zero_grad();
      auto loss = at::cross_entropy_loss(ddp(x), y);
      loss.backward();
      optimizer.step();
      step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
      loss_sum += loss.item<double>();
      ++batches;
      ++step;
      if (checkpoints && (step % arguments.checkpoint_every == 0 || step == total)) {
        save(step);
      }
    }
    if (batches == 0) {
      continue;
    }
    if (rank == 0) {
      // A terminal gets one line redrawn in place; a log file, a line per epoch.
      std::cerr << (::isatty(2) ? "\r" : "") << "epoch " << std::setw(3) << epoch + 1 << "/" << arguments.epochs << "  loss "
                << std::fixed << std::setprecision(4) << loss_sum / batches << (::isatty(2) ? "" : "\n") << std::flush;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t peak = tensor_peak.fullest_rank(group);
  torch::NoGradGuard no_grad;
  model->eval();
  const double accuracy = model->forward(test_x).argmax(1).eq(test_y).to(at::kDouble).mean().item<double>();
  if (rank == 0) {
    if (::isatty(2)) {
      std::cerr << std::endl;
    }
    std::cout << "train_ddp: " << world << " ranks (" << c10::utils::get_env("TORCHPAR_BACKEND").value_or("gloo")
              << "), " << arguments.epochs << " epochs in " << std::fixed << std::setprecision(2) << seconds
              << " s, " << 1e3 * step_seconds / std::max<int64_t>(1, total - done) << " ms per step, test accuracy "
              << std::setprecision(1) << 100 * accuracy << "%, peak tensor memory "
              << peak / 1024.0 << " KiB on the fullest rank" << std::endl;
  }
  return accuracy >= 0.95 ? 0 : 1;
}
