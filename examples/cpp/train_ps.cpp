// Trains the digits MLP through torchpar's parameter servers: the last ranks serve the parameters
// (and run SGD with momentum on them), the other ranks compute gradients on their share of the data,
// push them and pull the new values after every batch.
//
//   torchrun --nproc-per-node=3 --no-python build/examples/cpp/train_ps [--consistency bsp|ssp|asp]
//            [--staleness 2] [--servers 1] [--epochs 20] [--lr 0.1] [--batch-size 32]
//            [--checkpoint-dir DIR] [--data data/digits.pt]
//
// Worker 0 shows per-epoch progress and the held-out accuracy; exit status 1 if it is below 95%.
// With --checkpoint-dir a restarted job (torchrun --max-restarts) resumes from the servers' checkpoint.
#include <unistd.h>

#include <iomanip>
#include <iostream>
#include <string>

#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/index_select.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/data/samplers/distributed.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torchpar/torchpar.h>

#include "digits.h"

namespace {

struct Arguments {
  std::string data = "data/digits.pt";
  std::string consistency = "bsp";
  int staleness = 2;
  int servers = 0;
  int epochs = 20;
  double lr = 0.1;
  size_t batch_size = 32;
  std::string checkpoint_dir;
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
    } else if (flag == "--consistency") {
      arguments.consistency = value;
    } else if (flag == "--staleness") {
      arguments.staleness = std::stoi(value);
    } else if (flag == "--servers") {
      arguments.servers = std::stoi(value);
    } else if (flag == "--epochs") {
      arguments.epochs = std::stoi(value);
    } else if (flag == "--lr") {
      arguments.lr = std::stod(value);
    } else if (flag == "--batch-size") {
      arguments.batch_size = std::stoul(value);
    } else if (flag == "--checkpoint-dir") {
      arguments.checkpoint_dir = value;
    } else {
      throw std::invalid_argument("unknown option " + flag +
                                  " (--data, --consistency, --staleness, --servers, --epochs, --lr, --batch-size, "
                                  "--checkpoint-dir)");
    }
  }
  return arguments;
}

} // namespace

int main(int argc, char** argv) {
  Arguments arguments;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::unique_ptr<torchpar::ps::ParameterService> service;
  try {
    arguments = parse(argc, argv);
    group = torchpar::init_process_group();
    service = std::make_unique<torchpar::ps::ParameterService>(
        group, torchpar::ps::ServiceOptions()
                   .num_servers(arguments.servers)
                   .consistency(torchpar::ps::parse_consistency(arguments.consistency))
                   .staleness(arguments.staleness)
                   .checkpoint_dir(arguments.checkpoint_dir)
                   .stats_interval(std::chrono::seconds(5))
                   .log([](bool warning, const std::string& line) { std::cerr << line << std::endl; }));
  } catch (const torchpar::LaunchError& error) {
    std::cerr << "train_ps: " << error.what() << std::endl;
    return 2;
  } catch (const std::exception& error) {
    std::cerr << "train_ps: " << error.what() << std::endl;
    return 2;
  }
  if (service->is_server()) {
    const auto summary = service->serve();
    std::cerr << "train_ps: server " << service->server_index() << " answered " << summary.requests << " requests"
              << std::endl;
    return 0;
  }

  const int worker = service->worker_index();
  const int workers = service->num_workers();
  const auto [train_x, train_y, test_x, test_y] = load_digits(arguments.data);
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(64, 128), torch::nn::ReLU(), torch::nn::Linear(128, 10));
  // The parameters now live on the servers; step() pushes the gradients and pulls the new values.
  torchpar::ps::RemoteParameters parameters(service->client(), model->named_parameters(),
                                            torchpar::ps::OptimizerConfig::sgd(arguments.lr, 0.9), "digits.");
  torch::data::samplers::DistributedRandomSampler sampler(train_x.size(0), workers, worker, /*allow_duplicates=*/true);
  const int64_t resumed = parameters.clock(); // non-zero when the servers restored a checkpoint
  int64_t step = 0;
  for (int epoch = 0; epoch < arguments.epochs; ++epoch) {
    sampler.set_epoch(epoch);
    sampler.reset();
    double loss_sum = 0;
    int batches = 0;
    while (auto indices = sampler.next(arguments.batch_size)) {
      if (step++ < resumed) {
        continue;
      }
      const auto index = at::tensor(std::vector<int64_t>(indices->begin(), indices->end()));
      auto loss = at::cross_entropy_loss(model->forward(train_x.index_select(0, index)), train_y.index_select(0, index));
      loss.backward();
      parameters.step();
      loss_sum += loss.item<double>();
      ++batches;
    }
    if (worker == 0 && batches > 0) {
      std::cerr << (::isatty(2) ? "\r" : "") << "epoch " << std::setw(3) << epoch + 1 << "/" << arguments.epochs
                << "  loss " << std::fixed << std::setprecision(4) << loss_sum / batches
                << (::isatty(2) ? "" : "\n") << std::flush;
    }
  }
  torch::NoGradGuard no_grad;
  model->eval();
  const double accuracy = model->forward(test_x).argmax(1).eq(test_y).to(at::kDouble).mean().item<double>();
  service->finish();
  if (worker == 0) {
    if (::isatty(2)) {
      std::cerr << std::endl;
    }
    std::cout << "train_ps: " << workers << " workers, " << service->num_servers() << " servers, "
              << arguments.consistency << ", " << arguments.epochs << " epochs, test accuracy " << std::fixed
              << std::setprecision(1) << 100 * accuracy << "%" << std::endl;
  }
  return accuracy >= 0.95 ? 0 : 1;
}
