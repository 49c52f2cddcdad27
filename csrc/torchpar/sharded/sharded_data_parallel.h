// Sharded data parallelism (ZeRO stages 1, 2 and 3) for LibTorch modules. A training loop changes three lines:
//
//   namespace sh = torchpar::sharded;
//   sh::ShardedDataParallel sharded(model, sh::ShardedOptions().process_group(group).stage(2));
//   auto optimizer = sharded.optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3));  // on the shard
//   ...
//   optimizer.zero_grad();
//   torch::nll_loss(sharded(batch.data), batch.target).backward();  // was model->forward(...)
//   optimizer.step();                  // this rank's shard stepped, then every rank's shard all-gathered
//
// Stage 3 (.stage(3)) also shards the parameters: on a torch::nn::Sequential each child holding parameters is
// a unit gathered only around its forward and its backward (.units({"0", "2"}) chooses them); in any other module,
// each submodule it registers wrapped in a torchpar::sharded::Unit (unit.h).
#pragma once
#include <torchpar/common/module_tensors.h>
#include <torchpar/common/no_sync_guard.h>
#include <torchpar/sharded/sharded_checkpoint.h>
#include <torchpar/sharded/sharded_coordinator.h>
#include <torchpar/sharded/sharded_optimizer.h>
#include <torchpar/sharded/unit.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace torchpar::sharded {

using NoSyncGuard = torchpar::NoSyncGuard<ShardedCoordinator>;

// `ModuleHolder` is a LibTorch module holder (torch::nn::Sequential, or a TORCH_MODULE(Net) type).
template <typename ModuleHolder>
class ShardedDataParallel {
 public:
  // Stage 3 of a torch::nn::Sequential without units: each child holding a trained parameter of its own is one
  // (as Python's ShardedDataParallel, and FSDP2's fully_shard per block). On a Gloo group of one host the data goes
  // through an shm group over the same ranks (through_same_host_group; TORCHPAR_DDP_SAME_HOST=0: through Gloo).
  ShardedDataParallel(ModuleHolder module, ShardedOptions options)
      : module_(std::move(module)),
        coordinator_(std::make_unique<ShardedCoordinator>(
            named_parameters_of(*module_), named_buffers_of(*module_),
            through_same_host_group(with_default_units(std::move(options)), module_->parameters()))),
        child_units_(child_units(coordinator_->stage(), coordinator_->unit_names())) {
    attach_units();
  }
  ShardedDataParallel(ShardedDataParallel&&) noexcept = default;
  ShardedDataParallel& operator=(ShardedDataParallel&&) = delete;  // its units would keep the old coordinator
  ~ShardedDataParallel() {
    for (auto& unit : attached_units_) unit->detach();
  }

  // Stage 3: a Sequential whose units are its children gathers each unit just before the child's forward,
  // releases it after, and gathers it again when its output's gradient arrives (before the child's backward);
  // units that are Unit modules do the same themselves. Any other unit of a LibTorch module (no forward hooks to
  // gather it alone) makes the whole model gathered for the forward and released unit by unit as backward reduces it.
  template <typename... Args>
  auto forward(Args&&... args) {
    coordinator_->pre_forward(coordinator_->will_sync());
    if constexpr (std::is_same_v<ModuleHolder, torch::nn::Sequential>) {
      if (!child_units_.empty()) return forward_unit_by_unit(std::forward<Args>(args)...);
    }
    const bool units_gather_themselves = attached_units_.size() == coordinator_->unit_names().size();
    if (coordinator_->stage() == 3 && !units_gather_themselves) coordinator_->gather_all();
    return module_->forward(std::forward<Args>(args)...);
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // A LibTorch optimizer of type `Optimizer` over this rank's shard, stepping it and gathering the result.
  template <typename Optimizer, typename Options>
  ShardedOptimizer optimizer(Options options) {
    return ShardedOptimizer(*coordinator_, std::make_unique<Optimizer>(coordinator_->shard(), std::move(options)));
  }

  // Stage 3: every unit's parameters gathered (collective), to read them whole between steps, as FSDP2's
  // unshard; reshard() frees them again. Between steps a stage-3 parameter views no memory: reading it without
  // unshard() reads through a null pointer (Python refuses such a read; LibTorch tensors cannot be guarded).
  void unshard() {
    if (coordinator_->stage() == 3) coordinator_->gather_all();
  }
  void reshard() {
    if (coordinator_->stage() == 3) coordinator_->release_all();
  }

  // Stages 1-2: gradients that backward passes outside this wrapper's forward accumulated (a pipeline stage's
  // micro-batches) reduce-scattered into the shard now; then optimizer.step(). Collective.
  void reduce_gradients() { coordinator_->reduce_gradients(); }

  NoSyncGuard no_sync() { return NoSyncGuard(*coordinator_); }
  // Each rank writes its pieces of the model and of `optimizer`'s state to <directory>/rank-<r>-of-<N>.pt, nothing
  // gathered (sharded_checkpoint.h); load_checkpoint reads them on any number of ranks, at any stage (collective).
  // The whole model instead, loadable into a bare one: unshard(), torch::save(module(), path), reshard().
  void save_checkpoint(const std::string& directory, ShardedOptimizer& optimizer) {
    save_sharded_checkpoint(directory, optimizer, replicated_tensors());
  }
  void load_checkpoint(const std::string& directory, ShardedOptimizer& optimizer) {
    auto replicated = replicated_tensors();
    load_sharded_checkpoint(directory, optimizer, replicated);
  }
  ModuleHolder& module() { return module_; }
  ShardedCoordinator& coordinator() { return *coordinator_; }

 private:
  // What every rank holds whole: the buffers and the frozen parameters.
  NamedTensors replicated_tensors() const {
    auto replicated = named_buffers_of(*module_);
    for (auto& [name, parameter] : named_parameters_of(*module_)) {
      if (!parameter.requires_grad()) replicated.emplace_back(name, parameter);
    }
    return replicated;
  }
  ShardedOptions with_default_units(ShardedOptions options) const {
    if constexpr (std::is_same_v<ModuleHolder, torch::nn::Sequential>) {
      if (options.stage() == 3 && options.units().empty()) {
        // The children holding a trained parameter no other child holds (a tie's copies stay in the root).
        std::map<const void*, int> holders;
        for (const auto& child : module_->children()) {
          for (const auto& parameter : child->parameters()) ++holders[parameter.unsafeGetTensorImpl()];
        }
        std::vector<std::string> units;
        for (const auto& child : module_->named_children()) {
          const auto parameters = child.value()->parameters();
          if (std::any_of(parameters.begin(), parameters.end(), [&](const at::Tensor& parameter) {
                return parameter.requires_grad() && holders[parameter.unsafeGetTensorImpl()] == 1;
              })) {
            units.push_back(child.key());
          }
        }
        options.units(std::move(units));
      }
    } else if (options.stage() == 3 && options.units().empty()) {
      // The Unit modules it registers, in registration order (their forward order, as Python's units are).
      std::vector<std::string> units;
      for (const auto& item : module_->named_modules("", /*include_self=*/false)) {
        if (dynamic_cast<UnitImpl*>(item.value().get()) != nullptr) units.push_back(item.key());
      }
      options.units(std::move(units));
    }
    return options;
  }

  // Each Unit module the coordinator's units name, told its number.
  void attach_units() {
    if (coordinator_->stage() != 3) return;
    const auto& names = coordinator_->unit_names();
    for (const auto& item : module_->named_modules("", /*include_self=*/false)) {
      auto unit = std::dynamic_pointer_cast<UnitImpl>(item.value());
      const auto named = std::find(names.begin(), names.end(), item.key());
      if (unit && named != names.end()) {
        unit->attach(coordinator_.get(), static_cast<int>(named - names.begin()) + 1);
        attached_units_.push_back(std::move(unit));
      }
    }
  }

  // Per child of a Sequential, its unit (0: none, in the root); empty where the units are not all children.
  std::vector<int> child_units(int stage, const std::vector<std::string>& unit_names) const {
    if constexpr (std::is_same_v<ModuleHolder, torch::nn::Sequential>) {
      if (stage != 3) return {};
      std::vector<int> units(module_->size(), 0);
      const auto children = module_->named_children();
      for (size_t unit = 0; unit < unit_names.size(); ++unit) {
        const auto& name = unit_names[unit];
        size_t child = 0;
        while (child < children.size() && children[child].key() != name) ++child;
        if (child == children.size()) return {};  // a unit inside a child: gathered whole
        units[child] = static_cast<int>(unit) + 1;
      }
      return units;
    }
    return {};
  }

  template <typename... Args>
  at::Tensor forward_unit_by_unit(Args&&... args) {
    auto* coordinator = coordinator_.get();
    std::optional<torch::nn::AnyValue> value;
    size_t child = 0;
    for (auto& module : *module_) {
      const int unit = child_units_[child];
      if (unit > 0) coordinator->before_unit_forward(unit);
      value = child == 0 ? module.any_forward(std::forward<Args>(args)...) : module.any_forward(std::move(*value));
      if (unit > 0) {
        coordinator->after_unit_forward(unit);
        if (auto* output = value->template try_get<at::Tensor>()) coordinator->gather_before_backward_of(unit, *output);
      }
      ++child;
    }
    TORCH_CHECK(value, "ShardedDataParallel: forward of an empty Sequential");
    return value->template get<at::Tensor>();
  }

  ModuleHolder module_;
  std::unique_ptr<ShardedCoordinator> coordinator_;
  std::vector<int> child_units_;
  std::vector<std::shared_ptr<UnitImpl>> attached_units_;
};

} // namespace torchpar::sharded
