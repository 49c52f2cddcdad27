#pragma once
#include <functional>
#include <optional>
#include <string>

namespace torchpar::comm {

// Where this process sits in the job, as torchrun describes it through the environment.
struct LaunchConfig {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr; // empty when the caller brings its own store
  int master_port = 0;
  int restart_count = 0; // TORCHELASTIC_RESTART_COUNT: how often torchrun restarted the job
  bool use_agent_store = false; // TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent hosts the store
  bool bind_cores = false; // TORCHPAR_BIND_CORES=1: pin this rank to its share of the host's cores
};

// Values the program passes explicitly; they win over the environment.
struct LaunchOverrides {
  std::optional<int> rank;
  std::optional<int> world_size;
  bool has_store = false; // then MASTER_ADDR / MASTER_PORT are not needed
};

using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// Reads the real process environment.
EnvLookup process_environment();

// LOCAL_RANK, unset: nullopt. When it is not an integer, throws LaunchError from `caller` (e.g.
// "torchpar.new_group") naming the variable and its value.
std::optional<int> read_local_rank(const EnvLookup& env, const std::string& caller);
// LOCAL_WORLD_SIZE, likewise.
std::optional<int> read_local_world_size(const EnvLookup& env, const std::string& caller);

// Validates the launch and throws LaunchError naming the first thing wrong (all missing variables
// at once) and how to launch correctly.
LaunchConfig read_launch_config(const EnvLookup& env, const LaunchOverrides& overrides = {});

} // namespace torchpar::comm
