#include <torchpar/sharded/sharded_checkpoint.h>

#include <torchpar/common/module_tensors.h>
#include <torchpar/sharded/shard_layout.h>

#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
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

// A per-element state (Adam's moments, a momentum buffer) is shaped like the tensor stepped (a shard, a parameter);
// anything else (a step count) is one value for the whole tensor.
bool per_element(const c10::IValue& value, const at::Tensor& stepped) {
  return value.isTensor() && value.toTensor().sizes() == stepped.sizes();
}

torch::optim::OptimizerParamState* state_of(torch::optim::Optimizer& optimizer, const at::Tensor& shard) {
  const auto found = optimizer.state().find(shard.unsafeGetTensorImpl());
  return found == optimizer.state().end() ? nullptr : found->second.get();
}

// The optimizer's state on each of `stepped` made where it is missing, as torch's own checkpoint helpers do: a step
// of learning rate 0 on zero gradients, with the tensors that have a state left without a gradient (so not stepped).
void make_state(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& stepped) {
  const bool missing = std::any_of(stepped.begin(), stepped.end(),
                                   [&](const at::Tensor& tensor) { return state_of(optimizer, tensor) == nullptr; });
  if (!missing) return;
  std::vector<at::Tensor> kept_grads;
  for (auto tensor : stepped) {
    kept_grads.push_back(tensor.grad());
    tensor.mutable_grad() = state_of(optimizer, tensor) == nullptr ? at::zeros_like(tensor) : at::Tensor();
  }
  std::vector<double> learning_rates;
  for (auto& group : optimizer.param_groups()) {
    learning_rates.push_back(group.options().get_lr());
    group.options().set_lr(0.0);
  }
  optimizer.step();
  for (size_t i = 0; i < learning_rates.size(); ++i) optimizer.param_groups()[i].options().set_lr(learning_rates[i]);
  for (size_t i = 0; i < stepped.size(); ++i) {
    auto tensor = stepped[i];
    tensor.mutable_grad() = kept_grads[i];
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

int64_t whole_numel(const ShardLayout& layout, size_t parameter) {
  const auto [bucket, slot] = layout.location[parameter];
  return layout.buckets[bucket].slots[slot].numel;
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
      written.write("numel", c10::IValue(whole_numel(coordinator.layout(), piece.parameter)));
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

namespace {

// Where a parameter's loaded elements go: its flattened elements [start, start + numel) of `whole_numel`, into the
// tensor stepped (a shard, or the parameter itself) and each per-element tensor of its optimizer `state`, flat from
// `offset_in_stepped` on.
struct Target {
  int64_t whole_numel = 0;
  int64_t start = 0;
  int64_t numel = 0;
  at::Tensor stepped;
  StateEntries* state = nullptr;
  int64_t offset_in_stepped = 0;
  int64_t found = 0;
};

// Every rank's file of the checkpoint in `directory` read once: the elements each target wants, `replicated`, and the
// optimizer's options into `optimizer`'s groups. Fails naming what it lacks.
void read_checkpoint(const std::string& directory, std::map<std::string, Target>& targets, NamedTensors& replicated,
                     torch::optim::Optimizer& optimizer) {
  const int world = saved_world(directory);
  at::NoGradGuard no_grad;
  for (int rank = 0; rank < world; ++rank) {
    InputArchive archive;
    archive.load_from(file_of(directory, rank, world));
    c10::IValue count;
    archive.read("pieces", count);
    for (int64_t k = 0; k < count.toInt(); ++k) {
      InputArchive saved;
      archive.read("piece" + std::to_string(k), saved);
      c10::IValue name, offset, saved_numel;
      saved.read("name", name);
      saved.read("offset", offset);
      saved.read("numel", saved_numel);
      const auto here = targets.find(name.toStringRef());
      if (here == targets.end()) continue;
      auto& target = here->second;
      TORCH_CHECK(saved_numel.toInt() == target.whole_numel, "load_sharded_checkpoint: parameter ", name.toStringRef(),
                  " has ", saved_numel.toInt(), " elements in the checkpoint in ", directory, " and ",
                  target.whole_numel, " here: saved from another model?");
      // The saved piece's elements [from, to) of the parameter that the target wants too.
      at::Tensor values;
      saved.read("values", values);
      const int64_t saved_start = offset.toInt();
      const int64_t from = std::max(saved_start, target.start);
      const int64_t to = std::min(saved_start + values.numel(), target.start + target.numel);
      if (from >= to) continue;
      target.found += to - from;
      // Elements [from, to) of a tensor shaped as the stepped one, and of the saved piece's.
      const auto mine = [&target, from, to](const at::Tensor& stepped_like) {
        return stepped_like.view(-1).narrow(0, target.offset_in_stepped + from - target.start, to - from);
      };
      const auto theirs = [saved_start, from, to](const at::Tensor& saved_piece) {
        return saved_piece.narrow(0, from - saved_start, to - from);
      };
      mine(target.stepped).copy_(theirs(values));
      InputArchive saved_state;
      saved.read("state", saved_state);
      for (auto& [key, value] : *target.state) {
        c10::IValue saved_value;
        TORCH_CHECK(saved_state.try_read(key, saved_value), "load_sharded_checkpoint: the checkpoint in ", directory,
                    " has no optimizer state '", key, "' for parameter ", name.toStringRef(),
                    " (saved with another optimizer?)");
        if (per_element(value, target.stepped)) {
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
        TORCH_CHECK(found->second.sizes() == tensor.sizes(), "load_sharded_checkpoint: ", name, " is ",
                    found->second.sizes(), " in the checkpoint in ", directory, " and ", tensor.sizes(), " here");
        tensor.detach().copy_(found->second);
      }
      archive.read("options", options);
      for (auto& group : optimizer.param_groups()) group.options().serialize(options);
    }
  }
  for (const auto& [name, target] : targets) {
    TORCH_CHECK(target.found == target.numel, "load_sharded_checkpoint: the checkpoint in ", directory, " holds ",
                target.found, " of the ", target.numel, " elements of parameter ", name, " wanted (from element ",
                target.start, "): saved from another model?");
  }
}

} // namespace

void load_sharded_checkpoint(const std::string& directory, ShardedOptimizer& optimizer, NamedTensors& replicated) {
  auto& coordinator = optimizer.coordinator();
  const auto& names = coordinator.parameter_names();
  make_state(optimizer.inner(), coordinator.shard());
  std::vector<StateEntries> states;
  for (const auto& shard : coordinator.shard()) states.push_back(entries_of(*state_of(optimizer.inner(), shard)));
  std::map<std::string, Target> targets;
  for (size_t s = 0; s < coordinator.shard().size(); ++s) {
    const auto shard = coordinator.shard()[s].detach();
    for (const auto& piece : pieces_of(coordinator.layout(), s, coordinator.rank())) {
      targets[names[piece.parameter]] = {whole_numel(coordinator.layout(), piece.parameter), piece.parameter_offset,
                                         piece.numel, shard, &states[s], piece.shard_offset};
    }
  }
  read_checkpoint(directory, targets, replicated, optimizer.inner());
  for (size_t s = 0; s < coordinator.shard().size(); ++s) {
    assign(*state_of(optimizer.inner(), coordinator.shard()[s]), states[s]);
  }
  if (coordinator.stage() != 3) coordinator.gather_parameters();
}

void load_sharded_checkpoint(const std::string& directory, torch::nn::Module& module,
                             torch::optim::Optimizer& optimizer) {
  NamedTensors trained, replicated = named_buffers_of(module);
  std::set<const void*> seen;  // a tied parameter under its first name, as the wrapper saved it
  for (auto& [name, parameter] : named_parameters_of(module)) {
    if (!parameter.requires_grad()) {
      replicated.emplace_back(name, parameter);
    } else if (seen.insert(parameter.unsafeGetTensorImpl()).second) {
      trained.emplace_back(name, parameter);
    }
  }
  std::vector<at::Tensor> stepped;
  for (const auto& [name, parameter] : trained) stepped.push_back(parameter);
  make_state(optimizer, stepped);
  std::vector<StateEntries> states;
  for (const auto& parameter : stepped) {
    const auto* state = state_of(optimizer, parameter);
    TORCH_CHECK(state != nullptr, "load_sharded_checkpoint: the optimizer does not step parameter ",
                trained[states.size()].first, "; build it over the module's parameters");
    states.push_back(entries_of(*state));
  }
  std::map<std::string, Target> targets;
  for (size_t i = 0; i < trained.size(); ++i) {
    const auto parameter = trained[i].second.detach();
    targets[trained[i].first] = {parameter.numel(), 0, parameter.numel(), parameter, &states[i], 0};
  }
  read_checkpoint(directory, targets, replicated, optimizer);
  for (size_t i = 0; i < stepped.size(); ++i) assign(*state_of(optimizer, stepped[i]), states[i]);
}

} // namespace torchpar::sharded
