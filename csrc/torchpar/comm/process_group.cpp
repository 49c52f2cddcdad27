#include <torchpar/comm/process_group.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ATen/ops/tensor.h>

#include <torchpar/common/control_collectives.h>
#include <torchpar/common/host_id.h>
#include <torchpar/comm/backend_factory.h>
#include <torchpar/comm/core_binding.h>
#include <torchpar/comm/group_timeout.h>
#include <torchpar/comm/launch_config.h>
#include <torchpar/comm/named_process_group.h>
#include <torchpar/comm/store.h>

namespace torchpar::comm {
namespace {

constexpr std::chrono::minutes kDefaultTimeout{30};

c10d::ProcessGroup::BackendType backend_type(const std::string& name) {
  if (name == "nccl") {
    return c10d::ProcessGroup::BackendType::NCCL;
  }
  return name == "shm" ? c10d::ProcessGroup::BackendType::CUSTOM : c10d::ProcessGroup::BackendType::GLOO;
}

// Every rank creates its process groups in the same order (as with torch.distributed's group
// names), so a per-process counter names each group identically on all ranks.
std::string next_group_name() {
  static std::atomic<int> created{0};
  return "torchpar_pg" + std::to_string(created++);
}

// A process group named `group` on `group_store` with one backend per name in `choices`, shared by
// the devices it serves ("gloo" serves CPU and CUDA), as c10d does.
c10::intrusive_ptr<c10d::ProcessGroup> assemble(const std::string& group,
                                                const c10::intrusive_ptr<c10d::Store>& group_store,
                                                const std::vector<BackendChoice>& choices, int rank, int world_size,
                                                int local_rank, std::chrono::milliseconds timeout) {
  auto pg = c10::make_intrusive<NamedProcessGroup>(group_store, rank, world_size, choices.front().name);
  std::map<std::string, c10::intrusive_ptr<c10d::Backend>> backends;
  for (const auto& choice : choices) {
    auto& backend = backends[choice.name];
    if (!backend) {
      backend = make_backend(choice.name, c10::make_intrusive<c10d::PrefixStore>(choice.name + "/", group_store), rank,
                             world_size, local_rank, timeout);
    }
    pg->setBackend(choice.device, backend_type(choice.name), backend);
  }
  pg->setDefaultBackend(backend_type(choices.front().name));
  pg->setGroupName(group);
  return pg;
}

} // namespace

std::chrono::milliseconds resolve_timeout(const InitOptions& options) {
  if (options.timeout()) {
    TORCH_CHECK(options.timeout()->count() > 0, "torchpar.init_process_group: timeout must be positive");
    return *options.timeout();
  }
  if (auto text = process_environment()("TORCHPAR_TIMEOUT")) {
    double seconds = 0;
    std::size_t used = 0;
    try {
      seconds = std::stod(*text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    // The whole text must be the number ("500ms" is not 500 s), and one that fits in milliseconds.
    const double milliseconds = std::ceil(seconds * 1000);
    if (used == 0 || used != text->size() || !(milliseconds > 0) ||
        !(milliseconds < static_cast<double>(std::chrono::milliseconds::max().count()))) {
      throw LaunchError("torchpar.init_process_group: TORCHPAR_TIMEOUT='" + *text +
                        "' is not a positive number of seconds (e.g. TORCHPAR_TIMEOUT=0.5 for 500 ms)");
    }
    return std::chrono::milliseconds(static_cast<int64_t>(milliseconds));
  }
  return kDefaultTimeout;
}

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const InitOptions& options) {
  // TORCH_CPP_LOG_LEVEL, as torch's Python module applies it at import: without this a C++ program
  // shows no INFO line (torchpar's or c10d's) whatever it asks for.
  c10::initLogging();
  const auto env = process_environment();
  LaunchOverrides overrides{options.rank(), options.world_size(), options.store().defined()};
  const LaunchConfig config = read_launch_config(env, overrides);
  const auto timeout = resolve_timeout(options);
  const std::string spec =
      !options.backend().empty() ? options.backend() : env("TORCHPAR_BACKEND").value_or("gloo");
  const auto choices = parse_backend_spec(spec);
  check_backends_usable(choices, config.rank, config.local_rank);
  if (config.bind_cores) {
    bind_cores(config.local_rank, config.local_world_size);
  }

  auto store = options.store().defined() ? options.store() : connect_store(config, timeout);
  const std::string group = next_group_name();
  auto group_store = c10::make_intrusive<c10d::PrefixStore>(group + "/", store);
  wait_for_all_ranks(*group_store, config.rank, config.world_size, timeout);

  auto pg = assemble(group, group_store, choices, config.rank, config.world_size, config.local_rank, timeout);
  if (config.rank == 0) {
    LOG(INFO) << "torchpar: process group " << group << " ready: backend " << spec << ", "
              << config.world_size << " ranks, restart " << config.restart_count;
  }
  return pg;
}

c10::intrusive_ptr<c10d::ProcessGroup> new_group(const c10::intrusive_ptr<c10d::ProcessGroup>& parent,
                                                 const std::vector<int>& ranks, const InitOptions& options) {
  TORCH_CHECK(parent, "torchpar.new_group: no parent process group");
  const std::string group = next_group_name();
  std::vector<int> seen(parent->getSize(), 0);
  for (int rank : ranks) {
    TORCH_CHECK(rank >= 0 && rank < parent->getSize() && !seen[rank]++, "torchpar.new_group: rank ", rank,
                " is outside the parent group of ", parent->getSize(), " ranks or listed twice");
  }
  const auto position = std::find(ranks.begin(), ranks.end(), parent->getRank());
  if (position == ranks.end()) {
    return {};
  }
  const auto env = process_environment();
  const auto timeout = resolve_timeout(options);
  const std::string spec =
      !options.backend().empty() ? options.backend() : env("TORCHPAR_BACKEND").value_or("gloo");
  const auto choices = parse_backend_spec(spec);
  const int rank = static_cast<int>(position - ranks.begin());
  const int size = static_cast<int>(ranks.size());
  const int local_rank = read_local_rank(env, "torchpar.new_group").value_or(0);
  check_backends_usable(choices, rank, local_rank);
  auto group_store = c10::make_intrusive<c10d::PrefixStore>(group + "/", parent->getStore());
  wait_for_all_ranks(*group_store, rank, size, timeout);
  return assemble(group, group_store, choices, rank, size, local_rank, timeout);
}

bool shm_group_fits_beside(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  if (!group || group->getSize() < 2 || group->getBackendName() != "gloo" ||
      process_environment()("TORCHPAR_DDP_SAME_HOST").value_or("1") == "0") {
    return false;
  }
  const auto host = static_cast<int64_t>(std::hash<std::string>{}(host_id()));
  for (const auto& other : all_gather(*group, at::tensor({host}), at::kCPU)) {
    if (other.item<int64_t>() != host) return false;
  }
  return true;
}

c10::intrusive_ptr<c10d::ProcessGroup> shm_group_beside(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  if (!shm_group_fits_beside(group)) return {};
  const auto env = process_environment();
  std::string name;
  {
    static std::mutex mutex;
    static std::map<std::string, int> made;  // per group name
    std::lock_guard<std::mutex> lock(mutex);
    name = "torchpar_shm_beside_" + group->getGroupName() + "_" + std::to_string(made[group->getGroupName()]++);
  }
  const auto timeout = group_timeout(*group);
  auto group_store = c10::make_intrusive<c10d::PrefixStore>(name + "/", group->getStore());
  wait_for_all_ranks(*group_store, group->getRank(), group->getSize(), timeout);
  const int local_rank = read_local_rank(env, "torchpar.shm_group_beside").value_or(0);
  return assemble(name, group_store, parse_backend_spec("shm"), group->getRank(), group->getSize(), local_rank,
                  timeout);
}

} // namespace torchpar::comm
