// Trains an MLP too big for DDP under a memory cap on the 8x8 digits with torchpar's sharded data parallelism
// (ZeRO stage 1, 2 or 3) and Adam, then tests it; examples/python/train_sharded.py is the same program.
//
//   ./scripts/setup.sh                  # also writes data/digits.pt
//   torchrun --nproc-per-node=4 --no-python build/examples/cpp/train_sharded --stage 3 --memory-per-rank 48MiB
//            [--hidden 1024] [--layers 6] [--epochs 6] [--lr 1e-3] [--batch-size 32] [--bucket-cap-mb 4]
//            [--data data/digits.pt] [--no-keep-freed-memory]   (TORCHPAR_BACKEND=shm for shared memory)
//
// The MLP is 64-H-...-H-10 (--layers hidden layers of H; Ψ parameters, fp32, Adam). --memory-per-rank caps what the
// CPU allocator holds for a rank at its fullest moment (torchpar::cpu_allocations: the process's own libraries and
// buffers aside). Before anything is sharded two figures are predicted for each strategy on N ranks: the model state
// between steps by ZeRO's formulas and this engine's layout (DDP 16Ψ bytes; stage 1 8Ψ + 16S; stage 2 4Ψ + 16S;
// stage 3 16S, where S, Ψ/N plus each bucket's padding to a multiple of N, is the rank's shard: a flat fp32 copy the
// optimizer steps, its Adam state and averaged gradient), and the peak during a step by torchpar's planner
// (plan::profile_layers on the layers, plan::predict's memory lines: the state plus the buckets being
// reduce-scattered, the activations, Adam's temporaries, building the model whole). Rank 0 prints which peaks fit and
// the chosen stage's lines; a stage whose peak does not fit exits 2 with the message on stderr. Otherwise the
// program trains, measures the allocator's peak (the largest rank's) and the model state held after its last step
// (parameters and their gradients, the shard and its gradient, Adam's state; a storage once), and prints them beside
// the predictions in one line:
//   train_sharded: 4 ranks, stage 3, peak allocated 39.8 MiB per rank (predicted 40.2, DDP's 102.4, cap 48.0),
//   model state 20.3 MiB (predicted 20.3), resident set +33.9 MiB (predicted 33.1), 6 epochs in 8.97 s,
//   test accuracy 96.9%
// The resident set is the rank's growth from just before wrapping (the libraries' pages aside) under
// torchpar::keep_freed_memory(), as the planner predicts it: the tensors' peak beyond the model built whole, the
// shm segment's pages. --no-keep-freed-memory leaves freed memory to glibc; its resident set is then only measured.
// On a Gloo group of one host the wrapper's data goes through an shm group beside it (torchpar::shm_group_beside,
// made here first so that the prediction knows; TORCHPAR_DDP_SAME_HOST=0: through Gloo, whose reduce-scatter
// clones its input: a higher peak, predicted too).
// Exit status 1 when the accuracy is below 95% or the peak measured exceeds the cap.
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <fstream>
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

#include <torchpar/comm/shm/layout.h>
#include <torchpar/common/cpu_allocations.h>

#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <c10/util/env.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/data/samplers/distributed.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/any.h>
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
  int stage = 3;
  int64_t memory_per_rank = 48 << 20;
  bool keep_freed_memory = true;
  int64_t hidden = 1024;
  int64_t layers = 6;
  int epochs = 6;
  double lr = 1e-3;
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
    if (flag == "--no-keep-freed-memory") {
      arguments.keep_freed_memory = false;
      continue;
    }
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
    } else if (flag == "--layers") {
      arguments.layers = std::stoll(value);
    } else if (flag == "--epochs") {
      arguments.epochs = std::stoi(value);
    } else if (flag == "--lr") {
      arguments.lr = std::stod(value);
    } else if (flag == "--batch-size") {
      arguments.batch_size = std::stoul(value);
    } else if (flag == "--bucket-cap-mb") {
      arguments.bucket_cap_mb = std::stod(value);
    } else {
      throw std::invalid_argument("unknown option " + flag + " (--stage, --memory-per-rank, --hidden, --layers, "
                                  "--epochs, --lr, --batch-size, --bucket-cap-mb, --data, --no-keep-freed-memory)");
    }
  }
  if (arguments.hidden < 1 || arguments.layers < 1) {
    throw std::invalid_argument("--hidden and --layers must be at least 1");
  }
  return arguments;
}

// S: the elements of one rank's shard. The engine's buckets (torchpar/sharded/shard_layout.h): parameters in
// reverse registration order, a bucket closing once it holds at least its cap (the first's 1 MiB, as DDP's, then
// --bucket-cap-mb); each padded to a multiple of the group and cut into equal pieces, one per rank.
int64_t shard_elements(const std::vector<int64_t>& numels, int world, int64_t bucket_cap_bytes) {
  const int64_t first_cap_bytes = std::min<int64_t>(1 << 20, bucket_cap_bytes);
  int64_t shard = 0;
  int64_t open = 0;
  bool first = true;
  for (auto numel = numels.rbegin(); numel != numels.rend(); ++numel) {
    open += *numel;
    if (open * 4 >= (first ? first_cap_bytes : bucket_cap_bytes)) {
      shard += (open + world - 1) / world;
      open = 0;
      first = false;
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

// A strategy's two figures per rank: its model state between steps (by formula) and its peak (by the planner).
struct Prediction {
  std::string name;
  int64_t state_bytes;
  std::string formula;
  torchpar::plan::MemoryBreakdown peak;
};

// A hidden layer as the planner profiles it: the unit (its Linear) with the ReLU that follows, whose input and output
// are the activations backward keeps.
struct HiddenLayerImpl : torch::nn::Module {
  HiddenLayerImpl(int64_t in, int64_t out) : linear(register_module("linear", torch::nn::Linear(in, out))) {}
  at::Tensor forward(const at::Tensor& x) { return at::relu(linear(x)); }
  torch::nn::Linear linear;
};
TORCH_MODULE(HiddenLayer);

// The MLP's layers for the planner: a factory each.
std::vector<torchpar::pipeline::LayerFactory> mlp_layers(int64_t hidden, int64_t layers) {
  std::vector<torchpar::pipeline::LayerFactory> factories;
  for (int64_t i = 0; i < layers; ++i) {
    factories.push_back([i, hidden] {
      return torchpar::pipeline::layer_from_module("hidden" + std::to_string(i),
                                                   torch::nn::AnyModule(HiddenLayer(i == 0 ? 64 : hidden, hidden)));
    });
  }
  factories.push_back([hidden] {
    return torchpar::pipeline::layer_from_module("output", torch::nn::AnyModule(torch::nn::Linear(hidden, 10)));
  });
  return factories;
}

// Each strategy's peak per rank by the planner, from a profile of the layers in this process (their activations,
// and backward's temporaries as the allocator counts them); its resident set where freed memory is kept.
std::vector<torchpar::plan::MemoryBreakdown> peak_predictions(int64_t hidden, int64_t layers, int64_t batch,
                                                              const c10d::ProcessGroup& group, bool through_shm,
                                                              double bucket_cap_mb) {
  namespace plan = torchpar::plan;
  const auto model = plan::profile_layers(mlp_layers(hidden, layers), {at::randn({batch, 64})}, /*repeats=*/1);
  const int world = group.getSize();
  // The tensors need no timings, only how the reduce-scatters go: through Gloo, each clones its input.
  plan::NetworkProfile network;
  network.reduce_scatter_clones_input = group.getBackendName() == "gloo";
  network.host_memory.keeps_freed_memory = torchpar::keeping_freed_memory();
  if (through_shm) network.host_memory.shm_chunk_bytes = torchpar::comm::shm::kChunkBytes;
  plan::TrainingSetup setup;
  setup.batch = batch * world;
  setup.optimizer_state_factor = 2;  // Adam
  std::vector<plan::MemoryBreakdown> peaks;
  for (int stage = 0; stage <= 3; ++stage) {
    plan::Configuration configuration;
    configuration.world = world;
    if (stage > 0) {  // DDP keeps torch's bucket caps
      configuration.strategy = plan::Strategy::Sharded;
      configuration.zero_stage = stage;
      configuration.bucket_bytes = static_cast<int64_t>(bucket_cap_mb * kMiB);
    }
    peaks.push_back(plan::predict(model, network, setup, configuration).memory);
  }
  return peaks;
}

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

// A field of /proc/self/status in bytes (0 where Linux does not tell).
int64_t status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return 0;
}

// The resident set beyond the libraries' pages (code run for the first time is not memory held), after handing
// freed memory back and resetting the high-water mark that resident_peak() reads.
int64_t start_resident_watch() {
  torchpar::release_freed_memory();
  malloc_trim(0);
  std::ofstream("/proc/self/clear_refs") << "5";
  return status_bytes("VmRSS") - status_bytes("RssFile");
}

int64_t resident_peak() {
  return status_bytes("VmHWM") - status_bytes("RssFile");
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

  Digits digits;
  try {
    digits = load_digits(arguments.data);
  } catch (const std::invalid_argument& error) {
    if (rank == 0) std::cerr << "train_sharded: " << error.what() << std::endl;
    return 2;
  }
  const auto& [train_x, train_y, test_x, test_y] = digits;
  // The allocator's view of the peak: every CPU tensor allocation from here on is counted, beside the data; freed
  // blocks kept for reuse, as the planner measures (it counts too).
  if (arguments.keep_freed_memory) {
    torchpar::keep_freed_memory();
  } else {
    torchpar::count_cpu_allocations();
  }
  const int64_t allocated_before = torchpar::cpu_allocations().current;
  torch::manual_seed(0);
  const int64_t hidden = arguments.hidden;
  torch::nn::Sequential model;
  std::vector<std::string> units;  // stage 3's: the Linear layers, by their names in the Sequential
  for (int64_t i = 0; i <= arguments.layers; ++i) {
    units.push_back(std::to_string(model->size()));
    model->push_back(torch::nn::Linear(i == 0 ? 64 : hidden, i == arguments.layers ? 10 : hidden));
    if (i < arguments.layers) model->push_back(torch::nn::ReLU());
  }
  std::vector<int64_t> numels;
  for (const auto& parameter : model->parameters()) numels.push_back(parameter.numel());
  const int64_t psi = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  const int64_t shard = shard_elements(numels, world, static_cast<int64_t>(arguments.bucket_cap_mb * kMiB));
  std::vector<int64_t> unit_numels;
  for (const auto& unit : units) {
    int64_t numel = 0;
    for (const auto& parameter : model->named_children()[unit]->parameters()) numel += parameter.numel();
    unit_numels.push_back(numel);
  }
  const int64_t unit_shard = unit_shard_elements(unit_numels, world);
  // What the wrapper would do itself: on a Gloo group of one host, its data goes through an shm group beside it.
  const auto data_group = torchpar::shm_group_beside(group);
  auto peaks = peak_predictions(hidden, arguments.layers, static_cast<int64_t>(arguments.batch_size),
                                data_group ? *data_group : *group, data_group != nullptr,
                                arguments.bucket_cap_mb);
  const std::vector<Prediction> predicted = {
      {"DDP", 16 * psi, "4Ψ params + 4Ψ grads + 8Ψ Adam", peaks[0]},
      {"stage 1", 8 * psi + 16 * shard,
       "4Ψ + 4Ψ + 8Ψ/N (ZeRO) + 8S (the shard's copy and averaged gradient), S = " + std::to_string(shard), peaks[1]},
      {"stage 2", 4 * psi + 16 * shard, "4Ψ + 12Ψ/N (ZeRO) + 4S (the shard's copy), S = " + std::to_string(shard),
       peaks[2]},
      {"stage 3", 16 * unit_shard, "16Ψ/N (ZeRO), padded: 16S, S = " + std::to_string(unit_shard), peaks[3]},
  };
  const int64_t cap = arguments.memory_per_rank;
  if (rank == 0) {
    std::cerr << "MLP 64-" << hidden << "x" << arguments.layers << "-10: Ψ = " << psi << " fp32 parameters, Adam, "
              << world << " ranks, " << arguments.batch_size << " samples per rank; per rank, predicted, against the "
              << "cap of " << mib(cap) << " MiB on the peak:\n"
              << "                 peak      state\n";
    for (const auto& p : predicted) {
      std::cerr << "  " << std::left << std::setw(8) << p.name << std::right << std::setw(6)
                << mib(p.peak.tensor_bytes()) << " MiB" << std::setw(7) << mib(p.state_bytes) << " MiB  " << std::left
                << std::setw(7) << (p.peak.tensor_bytes() <= cap ? "fits" : "exceeds") << std::right
                << "  state: " << p.formula << "\n";
    }
  }
  const Prediction& chosen = predicted[arguments.stage];
  if (chosen.peak.tensor_bytes() > cap) {
    if (rank == 0) {
      std::string fitting;
      for (const auto& p : predicted) {
        if (p.peak.tensor_bytes() <= cap) fitting += (fitting.empty() ? "" : " and ") + p.name;
      }
      std::cerr << "train_sharded: " << chosen.name << " needs " << mib(chosen.peak.tensor_bytes())
                << " MiB per rank at its peak on " << world << " ranks, over --memory-per-rank " << mib(cap)
                << " MiB; " << (fitting.empty() ? "no strategy fits" : fitting + " would fit")
                << " (more ranks shrink the sharded parts)" << std::endl;
    }
    return 2;
  }
  if (rank == 0) std::cerr << chosen.name << " at its peak, by the planner:\n" << chosen.peak.render();
  // The profile's allocations are gone; the peak from here on is the model's, built whole, wrapped, trained.
  torchpar::reset_cpu_allocation_peak();
  const int64_t resident_before = start_resident_watch();
  const int64_t held_before = torchpar::cpu_allocations().current - allocated_before;  // the model built whole

  // The three lines that make it sharded: wrap the module, build the optimizer over this rank's shard, call the
  // wrapper. Rank 0's weights are copied to every rank; at stage 3 a rank keeps only its shard between steps.
  auto options = sh::ShardedOptions()
                     .process_group(data_group ? data_group : group)
                     .stage(arguments.stage)
                     .bucket_cap_mb(arguments.bucket_cap_mb);
  if (arguments.stage == 3) options.units(units);
  sh::ShardedDataParallel sharded(model, options);
  auto optimizer = sharded.optimizer<torch::optim::Adam>(torch::optim::AdamOptions(arguments.lr));
  // allow_duplicates: every rank gets ceil(N / world) samples, hence the same number of batches.
  torch::data::samplers::DistributedRandomSampler sampler(train_x.size(0), world, rank, /*allow_duplicates=*/true);

  int64_t steps = 0;
  double step_seconds = 0;  // the steps alone, the data handling aside
  const auto start = std::chrono::steady_clock::now();
  for (int epoch = 0; epoch < arguments.epochs; ++epoch) {
    sampler.set_epoch(epoch);
    sampler.reset();
    double loss_sum = 0;
    int batches = 0;
    while (auto indices = sampler.next(arguments.batch_size)) {
      const auto index = at::tensor(std::vector<int64_t>(indices->begin(), indices->end()));
      const auto x = train_x.index_select(0, index);
      const auto y = train_y.index_select(0, index);
      const auto step_start = std::chrono::steady_clock::now();
      optimizer.zero_grad();  // also releases the parameters' own gradients (stage 1 keeps them until here)
      auto loss = at::cross_entropy_loss(sharded(x), y);
      loss.backward();   // buckets reduce-scattered while backward runs
      optimizer.step();  // this rank's shard stepped, then every shard all-gathered into the parameters
      step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
      ++steps;
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
  const int64_t peak = torchpar::cpu_allocations().peak - allocated_before;
  const int64_t resident = resident_peak() - resident_before;
  const int64_t resident_predicted = chosen.peak.total() - held_before;
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
    std::cerr << " = " << mib(measured) << " MiB (predicted " << mib(chosen.state_bytes)
              << " MiB; measured - predicted = " << measured - chosen.state_bytes << " bytes)" << std::endl;
  }
  // The rank holding the most, of each.
  std::vector<at::Tensor> largest{at::tensor({peak, measured, resident}, at::kLong)};
  group->allreduce(largest, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
  const int64_t peak_measured = largest[0][0].item<int64_t>();
  measured = largest[0][1].item<int64_t>();
  const int64_t resident_measured = largest[0][2].item<int64_t>();

  torch::NoGradGuard no_grad;
  model->eval();
  // Through the wrapper: at stage 3 it gathers the parameters the rank does not hold.
  const double accuracy = sharded(test_x).argmax(1).eq(test_y).to(at::kDouble).mean().item<double>();
  if (rank == 0) {
    std::cout << "train_sharded: " << world << " ranks, " << chosen.name << ", peak allocated "
              << mib(static_cast<double>(peak_measured)) << " MiB per rank (predicted " << mib(chosen.peak.tensor_bytes())
              << ", DDP's " << mib(predicted[0].peak.tensor_bytes()) << ", cap " << mib(cap) << "), model state "
              << mib(measured) << " MiB (predicted " << mib(chosen.state_bytes) << "), resident set +"
              << mib(resident_measured) << " MiB ("
              << (arguments.keep_freed_memory ? "predicted " + mib(resident_predicted) : "glibc's, not predicted")
              << "), " << arguments.epochs
              << " epochs in " << std::fixed << std::setprecision(2) << seconds << " s, "
              << 1e3 * step_seconds / std::max<int64_t>(1, steps) << " ms per step, test accuracy "
              << std::setprecision(1) << 100 * accuracy << "%" << std::endl;
    if (accuracy < kTargetAccuracy) std::cerr << "train_sharded: below the 95% this example should reach" << std::endl;
    if (peak_measured > cap) std::cerr << "train_sharded: the peak measured exceeds the cap" << std::endl;
  }
  return accuracy >= kTargetAccuracy && peak_measured <= cap ? 0 : 1;
}
