// Trains a deep MLP on the 8x8 digits with torchpar's pipeline: the model's layers cut into one
// stage per rank, every batch split into micro-batches that flow through the stages.
//
//   ./scripts/setup.sh                  # also writes data/digits.pt
//   torchrun --nproc-per-node=2 --no-python build/examples/cpp/train_pipeline [--data data/digits.pt]
//            [--epochs 30] [--lr 0.05] [--batch-size 64] [--microbatches 4] [--schedule 1f1b]
//            [--checkpoint-dir ckpt [--checkpoint-every 50]]   (each rank saves its stage; resumes after a restart)
//            [--plan 2MiB]   (the planner picks the schedule, micro-batches and cut within 2 MiB per rank; 0: no cap;
//                             calibrated by what `python -m torchpar.plan --verify` learned on this machine, if it ran)
//            [--verify 2]    (with --plan: the top 2 run for real first, kept as calibration samples, and the pick
//                             planned again with what they taught)
//
// Each rank builds only its own stage's layers. Rank 0 shows per-epoch progress; the last stage's
// rank prints the held-out accuracy and the fullest rank's peak tensor memory while it trains (tensor_peak.h);
// every rank exits with status 1 if the accuracy is below 95%.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <iostream>
#include <optional>
#include <string>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/randperm.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/any.h>
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
  int epochs = 30;
  double lr = 0.05;
  int64_t batch_size = 64;
  int microbatches = 4;
  std::string schedule = "1f1b";
  std::string checkpoint_dir;
  int64_t checkpoint_every = 50;
  std::optional<int64_t> plan_memory_per_rank;  // --plan: the planner's cap (0: none)
  int verify = 0;                                // --verify: the planned configurations run for real first
};

// "2MiB", "512KiB", "1000000" as bytes.
int64_t parse_bytes(const std::string& text) {
  size_t end = 0;
  const double number = std::stod(text, &end);
  const std::string unit = text.substr(end);
  const double scale = unit.empty() || unit == "B" ? 1 : unit == "KiB" ? 1 << 10 : unit == "MiB" ? 1 << 20
                       : unit == "GiB" ? 1 << 30 : -1;
  if (scale < 0 || number < 0) throw std::invalid_argument("--plan " + text + ": a size such as 2MiB, 512KiB or 0");
  return static_cast<int64_t>(number * scale);
}

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
      arguments.batch_size = std::stol(value);
    } else if (flag == "--microbatches") {
      arguments.microbatches = std::stoi(value);
    } else if (flag == "--schedule") {
      arguments.schedule = value;
    } else if (flag == "--checkpoint-dir") {
      arguments.checkpoint_dir = value;
    } else if (flag == "--checkpoint-every") {
      arguments.checkpoint_every = std::stoll(value);
    } else if (flag == "--plan") {
      arguments.plan_memory_per_rank = parse_bytes(value);
    } else if (flag == "--verify") {
      arguments.verify = std::stoi(value);
    } else {
      throw std::invalid_argument("unknown option " + flag +
                                  " (--data, --epochs, --lr, --batch-size, --microbatches, --schedule, "
                                  "--checkpoint-dir, --checkpoint-every, --plan, --verify)");
    }
  }
  if (arguments.verify > 0 && !arguments.plan_memory_per_rank) {
    throw std::invalid_argument("--verify runs what --plan planned: give --plan too");
  }
  return arguments;
}

// Layer i of a 10-layer MLP; each factory seeds itself, so a layer's initial weights do not depend
// on which rank builds it.
std::vector<torchpar::pipeline::LayerFactory> mlp_layers() {
  const std::vector<std::pair<int64_t, int64_t>> linear{{64, 128}, {128, 128}, {128, 128}, {128, 128}, {128, 10}};
  std::vector<torchpar::pipeline::LayerFactory> factories;
  for (size_t i = 0; i < linear.size(); ++i) {
    factories.push_back([i, shape = linear[i]] {
      torch::manual_seed(static_cast<uint64_t>(i));
      return torchpar::pipeline::layer_from_module(
          "linear" + std::to_string(i), torch::nn::AnyModule(torch::nn::Linear(shape.first, shape.second)));
    });
    if (i + 1 < linear.size()) {
      factories.push_back([i] {
        return torchpar::pipeline::layer_from_module("relu" + std::to_string(i), torch::nn::AnyModule(torch::nn::ReLU()));
      });
    }
  }
  return factories;
}

} // namespace

int main(int argc, char** argv) {
  Arguments arguments;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    arguments = parse(argc, argv);
    group = torchpar::init_process_group();
  } catch (const torchpar::LaunchError& error) {
    std::cerr << "train_pipeline: " << error.what() << std::endl;
    return 2;
  } catch (const std::invalid_argument& error) {
    std::cerr << "train_pipeline: " << error.what() << std::endl;
    return 2;
  }
  const int rank = group->getRank();
  const int world = group->getSize();
  const auto [train_x, train_y, test_x, test_y] = load_digits(arguments.data);

  auto options = torchpar::pipeline::PipelineOptions().process_group(group);
  if (arguments.plan_memory_per_rank) {
    // The planner profiles the layers and this group, and picks among the pipelines the fastest that fits.
    namespace plan = torchpar::plan;
    plan::TrainingSetup setup;
    setup.batch = arguments.batch_size;
    plan::PlannedOnRanks planned;
    try {
      planned = plan::plan_on_ranks(
          group, mlp_layers(), {train_x.narrow(0, 0, arguments.batch_size / world)},
          plan::PlanOptions().memory_per_rank(*arguments.plan_memory_per_rank).microbatches({1, 2, 4, 8})
              .data_parallel(false).sharded(false).parameter_server(false).tensor_parallel(false),
          setup);
    } catch (const c10::Error& error) {
      std::cerr << "train_pipeline: " << error.what_without_backtrace() << std::endl;
      return 2;
    }
    if (rank == 0) {
      // What earlier `python -m torchpar.plan --verify` runs on this machine learned (the same store), if any.
      std::cerr << (planned.calibration_learned ? "calibration from earlier --verify runs: " : "default calibration: ")
                << plan::describe(planned.calibration) << "\n"
                << plan::render_table(planned.plan) << "memory per rank of the pick (its fullest rank):\n"
                << planned.plan.ranked.front().memory.render();
    }
    if (arguments.verify > 0) {
      // The top configurations trained for a few steps on one rank's share of the first batch, as a training
      // step runs, then the plan made again with the calibration they taught (kept for later plans).
      const int64_t per_rank = arguments.batch_size / world;
      const plan::TrainingRun run{{train_x.narrow(0, rank * per_rank, per_rank)},
                                  train_y.narrow(0, rank * per_rank, per_rank),
                                  [](const torchpar::pipeline::Tensors& outputs, const at::Tensor& target) {
                                    return at::cross_entropy_loss(outputs[0], target);
                                  },
                                  {}};
      const auto verified = plan::verify_plan_on_ranks(group, mlp_layers(), run, planned, arguments.verify);
      if (rank == 0) {
        std::cerr << "verified (step ms, predicted -> measured):\n";
        for (const auto& entry : verified.verified) {
          std::cerr << "  " << entry.configuration.describe() << ": " << entry.predicted_ms << " -> "
                    << entry.measured.step_ms << "\n";
        }
        std::cerr << "calibration fitted to " << verified.calibration_samples << " runs on this machine: "
                  << plan::describe(verified.replanned.calibration) << "\n"
                  << plan::render_table(verified.replanned.plan);
      }
      planned = verified.replanned;
    }
    arguments.schedule = torchpar::pipeline::schedule_name(planned.chosen.schedule);
    arguments.microbatches = planned.chosen.microbatches;
    options.virtual_stages(planned.chosen.virtual_stages).balance(planned.chosen.balance);
  }
  const TensorPeak tensor_peak;  // the planner's profile aside
  torchpar::pipeline::Pipeline pipe(
      mlp_layers(), [](const torchpar::pipeline::Tensors& outputs, const at::Tensor& target) {
        return at::cross_entropy_loss(outputs[0], target);
      },
      options.schedule(arguments.schedule).microbatches(arguments.microbatches));
  if (rank == 0) {
    std::cerr << "partition:\n" << pipe.partition_report();
  }
  torch::optim::SGD optimizer(pipe.parameters(), torch::optim::SGDOptions(arguments.lr).momentum(0.9));

  const int64_t batches = train_x.size(0) / arguments.batch_size;  // whole batches only: equal micro-batches
  const int64_t total = arguments.epochs * batches;

  // Each rank checkpoints its own stage: its parameters (by position), its optimizer, its generators.
  std::optional<torchpar::Checkpointer> checkpoints;
  int64_t done = 0;
  const auto parameters = pipe.parameters();
  if (!arguments.checkpoint_dir.empty()) {
    checkpoints.emplace(arguments.checkpoint_dir, group);
    if (const auto latest = checkpoints->latest_step()) {
      checkpoints->load(*latest, [&](torch::serialize::InputArchive& archive) {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < parameters.size(); ++i) {
          at::Tensor saved;
          archive.read("parameter." + std::to_string(i), saved);
          TORCH_CHECK(saved.sizes() == parameters[i].sizes(), "checkpoint step ", *latest, ": parameter ", i,
                      " of this rank's stage has shape ", saved.sizes(), ", the pipeline's has ", parameters[i].sizes(),
                      "; resume with the same layers, ranks and cut");
          parameters[i].copy_(saved);
        }
        torch::serialize::InputArchive optimizer_state;
        archive.read("optimizer", optimizer_state);
        optimizer.load(optimizer_state);
        torchpar::load_rng_state(archive);
      });
      done = *latest;
      if (rank == 0) {
        std::cerr << "train_pipeline: resumed from the checkpoint of step " << done << " of " << total << " in "
                  << arguments.checkpoint_dir << std::endl;
      }
    }
  }
  auto save = [&](int64_t step) {
    checkpoints->save(step, [&](torch::serialize::OutputArchive& archive) {
      for (size_t i = 0; i < parameters.size(); ++i) {
        archive.write("parameter." + std::to_string(i), parameters[i]);
      }
      torch::serialize::OutputArchive optimizer_state;
      optimizer.save(optimizer_state);
      archive.write("optimizer", optimizer_state);
      torchpar::save_rng_state(archive);
    });
  };

  int64_t step = 0;
  double step_seconds = 0;  // the steps alone, the data handling aside
  const auto start = std::chrono::steady_clock::now();
  for (int epoch = 0; epoch < arguments.epochs; ++epoch) {
    // Every rank draws the same order: the first stage reads the inputs, the last the targets.
    auto generator = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(epoch));
    const auto order = at::randperm(train_x.size(0), generator);
    double loss_sum = 0;
    int64_t trained = 0;
    for (int64_t batch = 0; batch < batches; ++batch) {
      if (++step <= done) {
        continue;
      }
      const auto index = order.narrow(0, batch * arguments.batch_size, arguments.batch_size);
      const auto x = train_x.index_select(0, index);
      const auto y = train_y.index_select(0, index);
      const auto step_start = std::chrono::steady_clock::now();
      optimizer.zero_grad();
      loss_sum += pipe.step(x, y).item<double>();
      optimizer.step();
      step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
      ++trained;
      if (checkpoints && (step % arguments.checkpoint_every == 0 || step == total)) {
        save(step);
      }
    }
    if (rank == 0 && trained > 0) {
      // A terminal gets one line redrawn in place; a log file, a line per epoch.
      std::cerr << (::isatty(2) ? "\r" : "") << "epoch " << std::setw(3) << epoch + 1 << "/" << arguments.epochs
                << "  loss " << std::fixed << std::setprecision(4) << loss_sum / trained << (::isatty(2) ? "" : "\n")
                << std::flush;
    }
  }
  if (rank == 0 && ::isatty(2)) {
    std::cerr << std::endl;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t peak = tensor_peak.fullest_rank(group);
  const auto outputs = pipe.forward({test_x});
  std::vector<at::Tensor> accuracy{at::zeros({1}, at::kDouble)};
  if (pipe.has_last_stage()) {
    accuracy[0].fill_(outputs[0].argmax(1).eq(test_y).to(at::kDouble).mean());
  }
  const int last_rank = torchpar::pipeline::rank_of_stage(pipe.schedule().stages() - 1, world);
  group->broadcast(accuracy, {last_rank, 0})->wait();
  const double value = accuracy[0].item<double>();
  if (pipe.has_last_stage()) {
    std::cout << "train_pipeline: " << world << " ranks, " << pipe.schedule().stages() << " stages, schedule "
              << arguments.schedule << ", " << arguments.microbatches << " micro-batches, " << arguments.epochs
              << " epochs in " << std::fixed << std::setprecision(2) << seconds << " s, "
              << 1e3 * step_seconds / std::max<int64_t>(1, total - done) << " ms per step, test accuracy "
              << std::setprecision(1) << 100 * value << "%, peak tensor memory " << peak / 1024.0
              << " KiB on the fullest rank" << std::endl;
  }
  return value >= 0.95 ? 0 : 1;
}
