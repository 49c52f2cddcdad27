#include <torchpar/comm/core_binding.h>

#include <torchpar/comm/launch_config.h>
#include <torchpar/comm/launch_error.h>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>

namespace torchpar::comm {
namespace {

int read_topology(int cpu, const char* field, int fallback) {
  std::ifstream file("/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/" + field);
  int value = fallback;
  return file >> value ? value : fallback;
}

constexpr const char* kBindCores = "torchpar.bind_cores";

// `given`, else the environment's `name` (read by `read`), else a LaunchError naming it.
int given_or_launched(std::optional<int> given, const char* name,
                      std::optional<int> (*read)(const EnvLookup&, const std::string&)) {
  if (given) return *given;
  if (auto value = read(process_environment(), kBindCores)) return *value;
  throw LaunchError(std::string(kBindCores) + ": environment variable " + name +
                    " is not set (launch with torchrun, or pass local_rank and local_world_size)");
}

std::string describe(const std::vector<int>& cpus) {
  std::ostringstream text;
  for (size_t i = 0; i < cpus.size(); ++i) text << (i ? "," : "") << cpus[i];
  return text.str();
}

} // namespace

CoreShare core_share(std::vector<LogicalCpu> available, int local_rank, int local_world_size) {
  TORCH_CHECK(local_world_size >= 1 && local_rank >= 0 && local_rank < local_world_size, "torchpar.bind_cores: local rank ",
              local_rank, " is out of range for ", local_world_size, " local ranks");
  TORCH_CHECK(!available.empty(), "torchpar.bind_cores: this process may run on no CPU");
  std::map<std::pair<int, int>, std::vector<int>> physical;  // (package, core) -> logical CPUs, in order
  for (const auto& cpu : available) physical[{cpu.package, cpu.core}].push_back(cpu.id);
  std::vector<std::vector<int>> cores;
  for (auto& [where, ids] : physical) {
    std::sort(ids.begin(), ids.end());
    cores.push_back(std::move(ids));
  }
  const auto count = static_cast<int64_t>(cores.size());
  CoreShare share;
  if (local_world_size > count) {
    for (const auto& cpu : available) share.cpus.push_back(cpu.id);
    std::sort(share.cpus.begin(), share.cpus.end());
    share.pinned = false;
    return share;
  }
  const int64_t first = local_rank * count / local_world_size, end = (local_rank + 1) * count / local_world_size;
  share.threads = static_cast<int>(end - first);
  for (auto core = first; core < end; ++core) {
    share.cpus.insert(share.cpus.end(), cores[static_cast<size_t>(core)].begin(), cores[static_cast<size_t>(core)].end());
  }
  std::sort(share.cpus.begin(), share.cpus.end());
  return share;
}

std::vector<LogicalCpu> available_cpus() {
  static const std::vector<LogicalCpu> first_seen = [] {
    cpu_set_t mask;
    CPU_ZERO(&mask);
    TORCH_CHECK(sched_getaffinity(0, sizeof(mask), &mask) == 0, "torchpar.bind_cores: sched_getaffinity: ",
                std::strerror(errno));
    std::vector<LogicalCpu> cpus;
    for (int id = 0; id < CPU_SETSIZE; ++id) {
      if (CPU_ISSET(id, &mask)) cpus.push_back({id, read_topology(id, "physical_package_id", 0), read_topology(id, "core_id", id)});
    }
    return cpus;
  }();
  return first_seen;
}

CoreShare bind_cores(std::optional<int> given_rank, std::optional<int> given_world_size) {
  const int local_rank = given_or_launched(given_rank, "LOCAL_RANK", read_local_rank);
  const int local_world_size = given_or_launched(given_world_size, "LOCAL_WORLD_SIZE", read_local_world_size);
  const auto share = core_share(available_cpus(), local_rank, local_world_size);
  if (!share.pinned) {
    LOG(WARNING) << "torchpar.bind_cores: " << local_world_size << " local ranks on fewer physical cores: left "
                 << "unpinned (ranks of unequal loads pinned to a shared core ran up to 1.5x slower)";
    return share;
  }
  cpu_set_t mask;
  CPU_ZERO(&mask);
  for (int cpu : share.cpus) CPU_SET(cpu, &mask);
  // sched_setaffinity binds one thread, and a thread inherits its creator's mask only as it starts: the
  // threads running already (the store's, Gloo's, ATen's pools) are bound one by one.
  TORCH_CHECK(sched_setaffinity(0, sizeof(mask), &mask) == 0, "torchpar.bind_cores: sched_setaffinity to CPUs ",
              describe(share.cpus), ": ", std::strerror(errno));
  if (DIR* tasks = opendir("/proc/self/task")) {
    while (const dirent* entry = readdir(tasks)) {
      if (entry->d_name[0] == '.') continue;
      // A thread may end meanwhile (ESRCH): nothing to bind then.
      sched_setaffinity(static_cast<pid_t>(std::stoi(entry->d_name)), sizeof(mask), &mask);
    }
    closedir(tasks);
  }
  at::set_num_threads(share.threads);
  LOG(INFO) << "torchpar: local rank " << local_rank << " of " << local_world_size << " bound to CPUs "
            << describe(share.cpus) << ", " << share.threads << " intra-op thread(s)";
  return share;
}

} // namespace torchpar::comm
