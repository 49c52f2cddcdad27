#include <torchpar/comm/launch_config.h>

#include <cstdlib>
#include <sstream>
#include <vector>

#include <torchpar/comm/launch_error.h>

namespace torchpar::comm {
namespace {

constexpr const char* kHowToLaunch =
    "launch with torchrun (e.g. `torchrun --nproc-per-node=2 prog`), or set RANK, WORLD_SIZE, "
    "MASTER_ADDR and MASTER_PORT yourself, or pass rank, world_size and a store explicitly";

constexpr const char* kInitProcessGroup = "torchpar.init_process_group";

[[noreturn]] void fail(const std::string& what, const std::string& caller = kInitProcessGroup) {
  throw LaunchError(caller + ": " + what + "; " + kHowToLaunch);
}

int parse_int(const std::string& name, const std::string& text, const std::string& caller = kInitProcessGroup) {
  std::size_t used = 0;
  long value = 0;
  try {
    value = std::stol(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size() || value < INT32_MIN || value > INT32_MAX) {
    fail(name + "='" + text + "' is not an integer", caller);
  }
  return static_cast<int>(value);
}

} // namespace

EnvLookup process_environment() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) {
      return std::nullopt;
    }
    return std::string(value);
  };
}

std::optional<int> read_local_rank(const EnvLookup& env, const std::string& caller) {
  if (auto text = env("LOCAL_RANK")) {
    return parse_int("LOCAL_RANK", *text, caller);
  }
  return std::nullopt;
}

std::optional<int> read_local_world_size(const EnvLookup& env, const std::string& caller) {
  if (auto text = env("LOCAL_WORLD_SIZE")) {
    return parse_int("LOCAL_WORLD_SIZE", *text, caller);
  }
  return std::nullopt;
}

LaunchConfig read_launch_config(const EnvLookup& env, const LaunchOverrides& overrides) {
  std::vector<std::string> required;
  if (!overrides.rank) {
    required.emplace_back("RANK");
  }
  if (!overrides.world_size) {
    required.emplace_back("WORLD_SIZE");
  }
  if (!overrides.has_store) {
    required.emplace_back("MASTER_ADDR");
    required.emplace_back("MASTER_PORT");
  }
  std::vector<std::string> missing;
  for (const auto& name : required) {
    if (!env(name)) {
      missing.push_back(name);
    }
  }
  if (!missing.empty()) {
    std::ostringstream names;
    for (std::size_t i = 0; i < missing.size(); ++i) {
      names << (i ? ", " : "") << missing[i];
    }
    fail(std::string(missing.size() == 1 ? "environment variable " : "environment variables ") +
         names.str() + (missing.size() == 1 ? " is" : " are") + " not set");
  }

  LaunchConfig config;
  config.world_size = overrides.world_size ? *overrides.world_size
                                           : parse_int("WORLD_SIZE", *env("WORLD_SIZE"));
  config.rank = overrides.rank ? *overrides.rank : parse_int("RANK", *env("RANK"));
  if (config.world_size < 1) {
    fail("WORLD_SIZE=" + std::to_string(config.world_size) + " must be at least 1");
  }
  if (config.rank < 0 || config.rank >= config.world_size) {
    fail("RANK=" + std::to_string(config.rank) + " is out of range for WORLD_SIZE=" +
         std::to_string(config.world_size) + " (valid ranks: 0.." +
         std::to_string(config.world_size - 1) + ")");
  }

  config.local_rank = read_local_rank(env, kInitProcessGroup).value_or(config.rank);
  config.local_world_size = read_local_world_size(env, kInitProcessGroup).value_or(config.world_size);
  if (config.local_world_size < 1 || config.local_rank < 0 ||
      config.local_rank >= config.local_world_size) {
    fail("LOCAL_RANK=" + std::to_string(config.local_rank) + " is out of range for LOCAL_WORLD_SIZE=" +
         std::to_string(config.local_world_size));
  }

  if (!overrides.has_store) {
    config.master_addr = *env("MASTER_ADDR");
    if (config.master_addr.empty()) {
      fail("MASTER_ADDR is empty");
    }
    config.master_port = parse_int("MASTER_PORT", *env("MASTER_PORT"));
    if (config.master_port < 1 || config.master_port > 65535) {
      fail("MASTER_PORT=" + std::to_string(config.master_port) + " is not a TCP port (1..65535)");
    }
  }
  if (auto restarts = env("TORCHELASTIC_RESTART_COUNT")) {
    config.restart_count = parse_int("TORCHELASTIC_RESTART_COUNT", *restarts);
  }
  // torch.distributed uses the agent's store only when the agent promised one (it exports this).
  config.use_agent_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  if (auto bind = env("TORCHPAR_BIND_CORES")) {
    if (*bind != "0" && *bind != "1") {
      fail("TORCHPAR_BIND_CORES='" + *bind + "' must be 1 (pin each local rank to its share of the cores) or 0");
    }
    config.bind_cores = *bind == "1";
  }
  return config;
}

} // namespace torchpar::comm
