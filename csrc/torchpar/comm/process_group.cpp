#include <torchpar/comm/process_group.h>

#include <atomic>
#include <map>

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <torchpar/comm/backend_factory.h>
#include <torchpar/comm/launch_config.h>
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

} // namespace

std::chrono::milliseconds resolve_timeout(const InitOptions& options) {
  if (options.timeout()) {
    TORCH_CHECK(options.timeout()->count() > 0, "torchpar.init_process_group: timeout must be positive");
    return *options.timeout();
  }
  if (auto text = process_environment()("TORCHPAR_TIMEOUT")) {
    double seconds = 0;
    try {
      seconds = std::stod(*text);
    } catch (const std::exception&) {
    }
    if (seconds <= 0) {
      throw LaunchError("torchpar.init_process_group: TORCHPAR_TIMEOUT='" + *text +
                        "' is not a positive number of seconds");
    }
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }
  return kDefaultTimeout;
}

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const InitOptions& options) {
  const auto env = process_environment();
  LaunchOverrides overrides{options.rank(), options.world_size(), options.store().defined()};
  const LaunchConfig config = read_launch_config(env, overrides);
  const auto timeout = resolve_timeout(options);
  const std::string spec =
      !options.backend().empty() ? options.backend() : env("TORCHPAR_BACKEND").value_or("gloo");
  const auto choices = parse_backend_spec(spec);
  check_backends_usable(choices, config.rank, config.local_rank);

  auto store = options.store().defined() ? options.store() : connect_store(config, timeout);
  const std::string group = next_group_name();
  auto group_store = c10::make_intrusive<c10d::PrefixStore>(group + "/", store);
  wait_for_all_ranks(*group_store, config.rank, config.world_size, timeout);

  auto pg = c10::make_intrusive<c10d::ProcessGroup>(group_store, config.rank, config.world_size);
  // One backend per name, shared by the devices it serves ("gloo" serves CPU and CUDA), as c10d does.
  std::map<std::string, c10::intrusive_ptr<c10d::Backend>> backends;
  for (const auto& choice : choices) {
    auto& backend = backends[choice.name];
    if (!backend) {
      backend = make_backend(
          choice.name, c10::make_intrusive<c10d::PrefixStore>(choice.name + "/", group_store),
          config.rank, config.world_size, config.local_rank, timeout);
    }
    pg->setBackend(choice.device, backend_type(choice.name), backend);
  }
  pg->setDefaultBackend(backend_type(choices.front().name));
  pg->setGroupName(group);
  if (config.rank == 0) {
    LOG(INFO) << "torchpar: process group " << group << " ready: backend " << spec << ", "
              << config.world_size << " ranks, restart " << config.restart_count;
  }
  return pg;
}

} // namespace torchpar::comm
