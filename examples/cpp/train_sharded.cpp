// Trains an MLP too big for DDP under a memory cap on the 8x8 digits with torchpar's sharded data parallelism
// (ZeRO stage 1, 2 or 3) and Adam, then tests it; examples/python/train_sharded.py is the same program.
//
//   ./scripts/setup.sh                  # also writes data/digits.pt
//   torchrun --nproc-per-node=4 --no-python build/examples/cpp/train_sharded --stage 2 --memory-per-rank 48MiB
//            [--hidden 2048] [--epochs 4] [--lr 2e-3] [--batch-size 32] [--bucket-cap-mb 4] [--data data/digits.pt]
//            (TORCHPAR_BACKEND=shm for shared memory)
//
// The MLP is 64-H-H-10 (Ψ parameters, fp32, Adam). Each strategy's model state per rank on N ranks is predicted
// before anything is sharded: DDP 16Ψ bytes; stage 1 4Ψ + 4Ψ + 8Ψ/N (ZeRO's formula) + 8S; stage 2 4Ψ + 12Ψ/N
// + 4S, where S (Ψ/N plus each bucket's padding to a multiple of N) is the rank's shard, which this engine keeps
// as a flat fp32 copy the optimizer steps (4S) and, at stage 1, whose averaged gradient it keeps beside every
// parameter's local one (4S); stage 3 16Ψ/N, padded 16S with each Linear layer a unit and the parameters no more
// than the shard between steps (during the forward and backward, the layer at work gathered beside it).
// Rank 0 prints which fit --memory-per-rank; a stage that does not fit exits 2 with the message on stderr. Otherwise the program trains, counts the bytes of the tensors the rank holds after its
// last step (parameters and their gradients, the shard and its gradient, Adam's state; a storage once) and
// prints them beside the prediction, ending with one line whose last figure is the allocator's peak during
// training (torchpar::cpu_allocations: the state plus what a step adds; the cap bounds the state, not this peak):
//   train_sharded: 4 ranks, stage 2, model state 33.2 MiB per rank (predicted 33.2, DDP would hold 66.4,
//   cap 48.0), 4 epochs in 5.55 s, test accuracy 98.1%, peak allocated 82.2 MiB
// Exit status 1 when the accuracy is below 95% or the measured state exceeds the cap.
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <map>
#include <numeric>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include <torchpar/common/cpu_allocations.h>

#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/index_select.h>
#include <c10/util/env.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/data/samplers/distributed.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torchpar/torchpar.h>

#include "digits.h"

namespace {

constexpr double kMiB = 1 << 20;
constexpr double kTargetAccuracy = 0.95;

struct Arguments {
  std::string data = "data/digits.pt";
  int stage = 2;
  int64_t memory_per_rank = 48 << 20;
  int64_t hidden = 2048;
  int epochs = 4;
  double lr = 2e-3;
  size_t batch_size = 32;
  double bucket_cap_mb = 4.0;
};

// "48MiB", "1GiB", "50MB", "50000000".
int64_t parse_bytes(const std::string& text) {
  static const std::map<std::string, double> units = {{"", 1},          {"B", 1},   {"KIB", 1 << 10}, {"MIB", 1 << 20},
                                                      {"GIB", 1 << 30}, {"KB", 1e3}, {"MB", 1e6},     {"GB", 1e9}};
  std::smatch match;
  static const std::regex size(R"(\s*([0-9.]+)\s*([A-Za-z]*)\s*)");
  std::string unit;
  if (std::regex_match(text, match, size)) {
    unit = match[2];
    for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  if (match.empty() || !units.count(unit)) {
    throw std::invalid_argument("--memory-per-rank '" + text + "': a size such as 48MiB, 1GiB or 50000000");
  }
  return static_cast<int64_t>(std::stod(match[1]) * units.at(unit));
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
    } else if (flag == "--stage") {
      arguments.stage = std::stoi(value);
      if (arguments.stage < 1 || arguments.stage > 3) {
        throw std::invalid_argument("--stage " + value + ": 1 (optimizer state), 2 (and gradients) or 3 (and "
                                    "parameters)");
      }
    } else if (flag == "--memory-per-rank") {
      arguments.memory_per_rank = parse_bytes(value);
    } else if (flag == "--hidden") {
      arguments.hidden = std::stoll(value);
    } else if (flag == "--epochs") {
      arguments.epochs = std::stoi(value);
    } else if (flag == "--lr") {
      arguments.lr = std::stod(value);
    } else if (flag == "--batch-size") {
      arguments.batch_size = std::stoul(value);
    } else if (flag == "--bucket-cap-mb") {
      arguments.bucket_cap_mb = std::stod(value);
    } else {
      throw std::invalid_argument("unknown option " + flag + " (--stage, --memory-per-rank, --hidden, --epochs, --lr, "
                                  "--batch-size, --bucket-cap-mb, --data)");
    }
  }
  return arguments;
}

// S: the elements of one rank's shard. The engine's buckets (torchpar/sharded/shard_layout.h): parameters in
// reverse registration order, a bucket closing once it holds at least the cap; each padded to a multiple of the
// group and cut into equal pieces, one per rank.
int64_t shard_elements(const std::vector<int64_t>& numels, int world, int64_t bucket_cap_bytes) {
  int64_t shard = 0;
  int64_t open = 0;
  for (auto numel = numels.rbegin(); numel != numels.rend(); ++numel) {
    open += *numel;
    if (open * 4 >= bucket_cap_bytes) {
      shard += (open + world - 1) / world;
      open = 0;
    }
  }
  return shard + (open + world - 1) / world;
}

// S at stage 3: each unit (here a Linear layer) is one bucket, padded to a multiple of the group.
int64_t unit_shard_elements(const std::vector<int64_t>& unit_numels, int world) {
  int64_t shard = 0;
  for (int64_t numel : unit_numels) shard += (numel + world - 1) / world;
  return shard;
}

struct Prediction {
  std::string name;
  int64_t bytes;
  std::string formula;
};

// Bytes of the distinct storages behind `tensors` not counted yet.
int64_t storage_bytes(const std::vector<at::Tensor>& tensors, std::unordered_set<const void*>& seen) {
  int64_t total = 0;
  for (const auto& tensor : tensors) {
    if (!tensor.defined()) continue;
    if (seen.insert(tensor.storage().unsafeGetStorageImpl()).second) {
      total += static_cast<int64_t>(tensor.storage().nbytes());
    }
  }
  return total;
}

std::string mib(double bytes) {
  std::ostringstream text;
  text << std::fixed << std::setprecision(1) << bytes / kMiB;
  return text.str();
}

} // namespace

int main(int argc, char** argv) {
  namespace sh = torchpar::sharded;
  Arguments arguments;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    arguments = parse(argc, argv);
    group = torchpar::init_process_group();
  } catch (const torchpar::LaunchError& error) {
    std::cerr << "train_sharded: " << error.what() << std::endl;
    return 2;
  } catch (const std::invalid_argument& error) {
    std::cerr << "train_sharded: " << error.what() << std::endl;
    return 2;
  }
  const int rank = group->getRank();
  const int world = group->getSize();

  // The allocator's view of the peak: every CPU tensor allocation from here on is counted.
  torchpar::count_cpu_allocations();
  const int64_t allocated_before = torchpar::cpu_allocations().current;
  torch::manual_seed(0);
  const int64_t hidden = arguments.hidden;
  torch::nn::Sequential model(torch::nn::Linear(64, hidden), torch::nn::ReLU(), torch::nn::Linear(hidden, hidden),
                              torch::nn::ReLU(), torch::nn::Linear(hidden, 10));
  std::vector<int64_t> numels;
  for (const auto& parameter : model->parameters()) numels.push_back(parameter.numel());
  const int64_t psi = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  const int64_t shard = shard_elements(numels, world, static_cast<int64_t>(arguments.bucket_cap_mb * kMiB));
  // Stage 3's units: the Sequential's Linear layers, by their names in it.
  const std::vector<std::string> units = {"0", "2", "4"};
  std::vector<int64_t> unit_numels;
  for (const auto& unit : units) {
    int64_t numel = 0;
    for (const auto& parameter : model->named_children()[unit]->parameters()) numel += parameter.numel();
    unit_numels.push_back(numel);
  }
  const int64_t unit_shard = unit_shard_elements(unit_numels, world);
  const std::vector<Prediction> predicted = {
      {"DDP", 16 * psi, "4Ψ params + 4Ψ grads + 8Ψ Adam"},
      {"stage 1", 8 * psi + 16 * shard,
       "4Ψ + 4Ψ + 8Ψ/N (ZeRO) + 8S (the shard's copy and averaged gradient), S = " + std::to_string(shard)},
      {"stage 2", 4 * psi + 16 * shard, "4Ψ + 12Ψ/N (ZeRO) + 4S (the shard's copy), S = " + std::to_string(shard)},
      {"stage 3", 16 * unit_shard, "16Ψ/N (ZeRO), padded: 16S, S = " + std::to_string(unit_shard)},
  };
  const int64_t cap = arguments.memory_per_rank;
  if (rank == 0) {
    std::cerr << "MLP 64-" << hidden << "-" << hidden << "-10: Ψ = " << psi << " fp32 parameters, Adam, " << world
              << " ranks; model state per rank, predicted, against the cap of " << mib(cap) << " MiB:\n";
    for (const auto& p : predicted) {
      std::cerr << "  " << std::left << std::setw(8) << p.name << std::right << std::setw(9) << mib(p.bytes)
                << " MiB  " << std::left << std::setw(7) << (p.bytes <= cap ? "fits" : "exceeds") << std::right
                << "  " << p.formula << "\n";
    }
  }
  const Prediction& chosen = predicted[arguments.stage];
  if (chosen.bytes > cap) {
    if (rank == 0) {
      std::string fitting;
      for (const auto& p : predicted) {
        if (p.bytes <= cap) fitting += (fitting.empty() ? "" : " and ") + p.name;
      }
      std::cerr << "train_sharded: " << chosen.name << " needs " << mib(chosen.bytes)
                << " MiB of model state per rank on " << world << " ranks, over --memory-per-rank " << mib(cap)
                << " MiB; "
                << (fitting.empty() ? "no strategy fits" : fitting + " would fit")
                << " (more ranks shrink the sharded parts)" << std::endl;
    }
    return 2;
  }

  Digits digits;
  try {
    digits = load_digits(arguments.data);
  } catch (const std::invalid_argument& error) {
    if (rank == 0) std::cerr << "train_sharded: " << error.what() << std::endl;
    return 2;
  }
  const auto& [train_x, train_y, test_x, test_y] = digits;
  // The three lines that make it sharded: wrap the module, build the optimizer over this rank's shard, call the
  // wrapper. Rank 0's weights are copied to every rank; at stage 3 a rank keeps only its shard between steps.
  auto options = sh::ShardedOptions().process_group(group).stage(arguments.stage).bucket_cap_mb(arguments.bucket_cap_mb);
  if (arguments.stage == 3) options.units(units);
  sh::ShardedDataParallel sharded(model, options);
  auto optimizer = sharded.optimizer<torch::optim::Adam>(torch::optim::AdamOptions(arguments.lr));
  // allow_duplicates: every rank gets ceil(N / world) samples, hence the same number of batches.
  torch::data::samplers::DistributedRandomSampler sampler(train_x.size(0), world, rank, /*allow_duplicates=*/true);

  const auto start = std::chrono::steady_clock::now();
  for (int epoch = 0; epoch < arguments.epochs; ++epoch) {
    sampler.set_epoch(epoch);
    sampler.reset();
    double loss_sum = 0;
    int batches = 0;
    while (auto indices = sampler.next(arguments.batch_size)) {
      const auto index = at::tensor(std::vector<int64_t>(indices->begin(), indices->end()));
      optimizer.zero_grad();  // also releases the parameters' own gradients (stage 1 keeps them until here)
      auto loss = at::cross_entropy_loss(sharded(train_x.index_select(0, index)), train_y.index_select(0, index));
      loss.backward();   // buckets reduce-scattered while backward runs
      optimizer.step();  // this rank's shard stepped, then every shard all-gathered into the parameters
      loss_sum += loss.item<double>();
      ++batches;
    }
    if (rank == 0 && batches > 0) {
      // A terminal gets one line redrawn in place; a log file, a line per epoch.
      std::cerr << (::isatty(2) ? "\r" : "") << "epoch " << std::setw(3) << epoch + 1 << "/" << arguments.epochs
                << "  loss " << std::fixed << std::setprecision(4) << loss_sum / batches << (::isatty(2) ? "" : "\n")
                << std::flush;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::vector<at::Tensor> peak{at::tensor({torchpar::cpu_allocations().peak - allocated_before}, at::kLong)};
  group->allreduce(peak, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
  if (rank == 0 && ::isatty(2)) std::cerr << std::endl;

  // What the rank holds after its last step, before the next zero_grad: the most it holds between steps.
  std::unordered_set<const void*> seen;
  std::vector<at::Tensor> parameters = model->parameters();
  std::vector<at::Tensor> gradients;
  for (const auto& parameter : parameters) gradients.push_back(parameter.grad());
  for (const auto& piece : sharded.coordinator().shard()) gradients.push_back(piece.grad());
  std::vector<at::Tensor> adam_state;
  for (const auto& entry : optimizer.inner().state()) {
    const auto& state = static_cast<const torch::optim::AdamParamState&>(*entry.second);
    adam_state.insert(adam_state.end(), {state.exp_avg(), state.exp_avg_sq(), state.max_exp_avg_sq()});
  }
  const std::vector<std::pair<std::string, int64_t>> held = {
      {"parameters", storage_bytes(parameters, seen)},
      {"shard", storage_bytes(sharded.coordinator().shard(), seen)},
      {"gradients", storage_bytes(gradients, seen)},
      {"optimizer state", storage_bytes(adam_state, seen)},
  };
  int64_t measured = 0;
  for (const auto& [kind, bytes] : held) measured += bytes;
  if (rank == 0) {
    std::cerr << "held after the last step: ";
    for (size_t i = 0; i < held.size(); ++i) {
      std::cerr << (i ? ", " : "") << held[i].first << " " << std::fixed << std::setprecision(2)
                << held[i].second / kMiB << " MiB";
    }
    std::cerr << " = " << mib(measured) << " MiB (predicted " << mib(chosen.bytes)
              << " MiB; measured - predicted = " << measured - chosen.bytes << " bytes)" << std::endl;
  }
  {
    // The rank holding the most.
    std::vector<at::Tensor> largest{at::tensor({measured}, at::kLong)};
    group->allreduce(largest, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
    measured = largest[0].item<int64_t>();
  }

  torch::NoGradGuard no_grad;
  model->eval();
  // Through the wrapper: at stage 3 it gathers the parameters the rank does not hold.
  const double accuracy = sharded(test_x).argmax(1).eq(test_y).to(at::kDouble).mean().item<double>();
  if (rank == 0) {
    std::cout << "train_sharded: " << world << " ranks, " << chosen.name << ", model state " << mib(measured)
              << " MiB per rank (predicted " << mib(chosen.bytes) << ", DDP would hold " << mib(predicted[0].bytes)
              << ", cap " << mib(cap) << "), " << arguments.epochs << " epochs in " << std::fixed
              << std::setprecision(2) << seconds << " s, test accuracy " << std::setprecision(1) << 100 * accuracy
              << "%, peak allocated " << mib(static_cast<double>(peak[0].item<int64_t>())) << " MiB" << std::endl;
    if (accuracy < kTargetAccuracy) std::cerr << "train_sharded: below the 95% this example should reach" << std::endl;
    if (measured > cap) std::cerr << "train_sharded: the model state measured exceeds the cap" << std::endl;
  }
  return accuracy >= kTargetAccuracy && measured <= cap ? 0 : 1;
}
