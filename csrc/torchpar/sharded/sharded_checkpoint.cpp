#include <torchpar/sharded/sharded_checkpoint.h>

#include <torchpar/sharded/shard_layout.h>

#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <sstream>
#include <utility>
#include <vector>

namespace torchpar::sharded {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

// An optimizer's state on one tensor as (key, value) pairs, and back. LibTorch's optimizer states only serialize
// themselves (AdamParamState's step and moments, SGD's momentum buffer, ...): the pairs are read back out of that.
using StateEntries = std::vector<std::pair<std::string, c10::IValue>>;

StateEntries entries_of(const torch::optim::OptimizerParamState& state) {
  OutputArchive written;
  state.serialize(written);
  std::stringstream bytes;
  written.save_to(bytes);
  InputArchive read;
  read.load_from(bytes);
  StateEntries entries;
  for (const auto& key : read.keys()) {
    c10::IValue value;
    read.read(key, value);
    entries.emplace_back(key, std::move(value));
  }
  return entries;
}

void assign(torch::optim::OptimizerParamState& state, const StateEntries& entries) {
  OutputArchive written;
  for (const auto& [key, value] : entries) written.write(key, value);
  std::stringstream bytes;
  written.save_to(bytes);
  InputArchive read;
  read.load_from(bytes);
  state.serialize(read);
}

// A per-element state (Adam's moments, a momentum buffer) is shaped like the shard; anything else (a step count)
// is one value for the whole shard.
bool per_element(const c10::IValue& value, const at::Tensor& shard) {
  return value.isTensor() && value.toTensor().dim() == 1 && value.toTensor().numel() == shard.numel();
}

torch::optim::OptimizerParamState* state_of(torch::optim::Optimizer& optimizer, const at::Tensor& shard) {
  const auto found = optimizer.state().find(shard.unsafeGetTensorImpl());
  return found == optimizer.state().end() ? nullptr : found->second.get();
}

// Each shard's optimizer state made where it is missing, as torch's own checkpoint helpers do: a step of learning
// rate 0 on zero gradients, with the shards that have a state left without a gradient (so not stepped).
void make_state(ShardedOptimizer& optimizer) {
  auto& inner = optimizer.inner();
  const auto& shards = optimizer.coordinator().shard();
  const bool missing = std::any_of(shards.begin(), shards.end(),
                                   [&](const at::Tensor& shard) { return state_of(inner, shard) == nullptr; });
  if (!missing) return;
  std::vector<at::Tensor> kept_grads;
  for (auto shard : shards) {
    kept_grads.push_back(shard.grad());
    shard.mutable_grad() = state_of(inner, shard) == nullptr ? at::zeros_like(shard) : at::Tensor();
  }
  std::vector<double> learning_rates;
  for (auto& group : inner.param_groups()) {
    learning_rates.push_back(group.options().get_lr());
    group.options().set_lr(0.0);
  }
  inner.step();
  for (size_t i = 0; i < learning_rates.size(); ++i) inner.param_groups()[i].options().set_lr(learning_rates[i]);
  for (size_t i = 0; i < shards.size(); ++i) {
    auto shard = shards[i];
    shard.mutable_grad() = kept_grads[i];
  }
}

std::string file_of(const std::string& directory, int rank, int world) {
  return (std::filesystem::path(directory) / ("rank-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".pt"))
      .string();
}

// The group size the checkpoint in `directory` was saved on, every rank's file checked present.
int saved_world(const std::string& directory) {
  TORCH_CHECK(std::filesystem::is_directory(directory), "load_sharded_checkpoint: no directory ", directory);
  int world = 0;
  for (const auto& file : std::filesystem::directory_iterator(directory)) {
    const auto name = file.path().filename().string();
    const auto of = name.find("-of-");
    if (name.rfind("rank-", 0) != 0 || of == std::string::npos || file.path().extension() != ".pt") continue;
    const int this_world = std::stoi(name.substr(of + 4));
    TORCH_CHECK(world == 0 || world == this_world, "load_sharded_checkpoint: ", directory,
                " holds checkpoints of ", world, " and of ", this_world, " ranks; keep one per directory");
    world = this_world;
  }
  TORCH_CHECK(world > 0, "load_sharded_checkpoint: no rank-<r>-of-<N>.pt file in ", directory);
  for (int rank = 0; rank < world; ++rank) {
    TORCH_CHECK(std::filesystem::exists(file_of(directory, rank, world)), "load_sharded_checkpoint: ", directory,
                " holds a checkpoint of ", world, " ranks without rank ", rank, "'s file ",
                file_of(directory, rank, world));
  }
  return world;
}

} // namespace

void save_sharded_checkpoint(const std::string& directory, ShardedOptimizer& optimizer,
                             const NamedTensors& replicated) {
  auto& coordinator = optimizer.coordinator();
  const auto& names = coordinator.parameter_names();
  OutputArchive archive;
  int64_t count = 0;
  for (size_t s = 0; s < coordinator.shard().size(); ++s) {
    const auto& shard = coordinator.shard()[s];
    const auto* state = state_of(optimizer.inner(), shard);
    const auto entries = state == nullptr ? StateEntries{} : entries_of(*state);
    for (const auto& piece : pieces_of(coordinator.layout(), s, coordinator.rank())) {
      OutputArchive written;
      written.write("name", c10::IValue(names[piece.parameter]));
      written.write("offset", c10::IValue(piece.parameter_offset));
      // A clone: a view would write the whole shard's storage.
      written.write("values", shard.detach().narrow(0, piece.shard_offset, piece.numel).clone());
      OutputArchive written_state;
      for (const auto& [key, value] : entries) {
        written_state.write(key, per_element(value, shard)
                                     ? c10::IValue(value.toTensor().narrow(0, piece.shard_offset, piece.numel).clone())
                                     : value);
      }
      written.write("state", written_state);
      archive.write("piece" + std::to_string(count++), written);
    }
  }
  archive.write("pieces", c10::IValue(count));
  OutputArchive written_replicated;
  for (size_t i = 0; i < replicated.size(); ++i) {
    written_replicated.write("name" + std::to_string(i), c10::IValue(replicated[i].first));
    written_replicated.write("value" + std::to_string(i), replicated[i].second.detach());
  }
  written_replicated.write("count", c10::IValue(static_cast<int64_t>(replicated.size())));
  archive.write("replicated", written_replicated);
  OutputArchive options;
  optimizer.inner().param_groups().front().options().serialize(options);
  archive.write("options", options);
  std::filesystem::create_directories(directory);
  archive.save_to(file_of(directory, coordinator.rank(), coordinator.layout().world));
}

void load_sharded_checkpoint(const std::string& directory, ShardedOptimizer& optimizer, NamedTensors& replicated) {
  auto& coordinator = optimizer.coordinator();
  const auto& names = coordinator.parameter_names();
  const int world = saved_world(directory);
  make_state(optimizer);

  // This rank's pieces by parameter name, what its shard's state holds, and how much of each piece was found.
  struct Wanted {
    size_t shard;
    ShardPiece piece;
    int64_t found = 0;
  };
  std::map<std::string, Wanted> wanted;
  std::vector<StateEntries> states;
  for (size_t s = 0; s < coordinator.shard().size(); ++s) {
    for (const auto& piece : pieces_of(coordinator.layout(), s, coordinator.rank())) {
      wanted[names[piece.parameter]] = {s, piece};
    }
    states.push_back(entries_of(*state_of(optimizer.inner(), coordinator.shard()[s])));
  }

  at::NoGradGuard no_grad;
  for (int rank = 0; rank < world; ++rank) {
    InputArchive archive;
    archive.load_from(file_of(directory, rank, world));
    c10::IValue count;
    archive.read("pieces", count);
    for (int64_t k = 0; k < count.toInt(); ++k) {
      InputArchive saved;
      archive.read("piece" + std::to_string(k), saved);
      c10::IValue name, offset;
      saved.read("name", name);
      saved.read("offset", offset);
      const auto here = wanted.find(name.toStringRef());
      if (here == wanted.end()) continue;
      auto& entry = here->second;
      const auto& piece = entry.piece;
      const size_t s = entry.shard;
      // The saved piece's elements [from, to) of the parameter that this rank's piece holds too.
      at::Tensor values;
      saved.read("values", values);
      const int64_t from = std::max(offset.toInt(), piece.parameter_offset);
      const int64_t to = std::min(offset.toInt() + values.numel(), piece.parameter_offset + piece.numel);
      if (from >= to) continue;
      entry.found += to - from;
      const int64_t saved_start = offset.toInt();
      const auto mine = [&piece, from, to](const at::Tensor& shard_like) {
        return shard_like.narrow(0, piece.shard_offset + from - piece.parameter_offset, to - from);
      };
      const auto theirs = [saved_start, from, to](const at::Tensor& saved_piece) {
        return saved_piece.narrow(0, from - saved_start, to - from);
      };
      mine(coordinator.shard()[s].detach()).copy_(theirs(values));
      InputArchive saved_state;
      saved.read("state", saved_state);
      for (auto& [key, value] : states[s]) {
        c10::IValue saved_value;
        TORCH_CHECK(saved_state.try_read(key, saved_value), "load_sharded_checkpoint: the checkpoint in ", directory,
                    " has no optimizer state '", key, "' for parameter ", name.toStringRef(),
                    " (saved with another optimizer?)");
        if (per_element(value, coordinator.shard()[s])) {
          mine(value.toTensor()).copy_(theirs(saved_value.toTensor()));
        } else {
          value = saved_value;
        }
      }
    }
    if (rank == 0) {
      InputArchive saved_replicated, options;
      archive.read("replicated", saved_replicated);
      c10::IValue count_replicated;
      saved_replicated.read("count", count_replicated);
      std::map<std::string, at::Tensor> saved_values;
      for (int64_t i = 0; i < count_replicated.toInt(); ++i) {
        c10::IValue name;
        at::Tensor value;
        saved_replicated.read("name" + std::to_string(i), name);
        saved_replicated.read("value" + std::to_string(i), value);
        saved_values[name.toStringRef()] = value;
      }
      for (auto& [name, tensor] : replicated) {
        const auto found = saved_values.find(name);
        TORCH_CHECK(found != saved_values.end(), "load_sharded_checkpoint: the checkpoint in ", directory,
                    " has no value for ", name);
        tensor.detach().copy_(found->second);
      }
      archive.read("options", options);
      for (auto& group : optimizer.inner().param_groups()) group.options().serialize(options);
    }
  }
  for (const auto& [name, entry] : wanted) {
    TORCH_CHECK(entry.found == entry.piece.numel, "load_sharded_checkpoint: the checkpoint in ", directory,
                " holds ", entry.found, " of the ", entry.piece.numel, " elements of parameter ", name,
                " that rank ", coordinator.rank(), " needs (from element ", entry.piece.parameter_offset,
                "): saved from another model?");
  }
  for (size_t s = 0; s < coordinator.shard().size(); ++s) {
    assign(*state_of(optimizer.inner(), coordinator.shard()[s]), states[s]);
  }
  if (coordinator.stage() != 3) coordinator.gather_parameters();
}

} // namespace torchpar::sharded
