#include <map>

#include "catch_with_torch.h"
#include <torchpar/comm/launch_config.h>
#include <torchpar/comm/launch_error.h>

using torchpar::comm::LaunchError;
using torchpar::comm::LaunchOverrides;
using torchpar::comm::read_launch_config;
using Catch::Matchers::Contains;

namespace {

torchpar::comm::EnvLookup env_of(std::map<std::string, std::string> values) {
  return [values](const std::string& name) -> std::optional<std::string> {
    auto it = values.find(name);
    return it == values.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
}

std::map<std::string, std::string> torchrun_env() {
  return {{"RANK", "3"},        {"WORLD_SIZE", "4"},  {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29400"},
          {"TORCHELASTIC_RESTART_COUNT", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
}

std::string launch_error_of(std::map<std::string, std::string> values, LaunchOverrides overrides = {}) {
  try {
    read_launch_config(env_of(std::move(values)), overrides);
  } catch (const LaunchError& e) {
    return e.what();
  }
  return "no error";
}

} // namespace

TEST_CASE("a torchrun environment is read completely", "[launch]") {
  const auto config = read_launch_config(env_of(torchrun_env()));
  CHECK(config.rank == 3);
  CHECK(config.world_size == 4);
  CHECK(config.local_rank == 1);
  CHECK(config.local_world_size == 2);
  CHECK(config.master_addr == "node0");
  CHECK(config.master_port == 29400);
  CHECK(config.restart_count == 2);
  CHECK(config.use_agent_store);
}

TEST_CASE("without LOCAL_* variables a single host is assumed, and no agent store", "[launch]") {
  const auto config = read_launch_config(env_of(
      {{"RANK", "1"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1234"},
       {"TORCHELASTIC_USE_AGENT_STORE", "False"}}));
  CHECK(config.local_rank == 1);
  CHECK(config.local_world_size == 3);
  CHECK(config.restart_count == 0);
  CHECK_FALSE(config.use_agent_store);
}

TEST_CASE("TORCHPAR_BIND_CORES is 1 or 0, off when unset", "[launch]") {
  CHECK_FALSE(read_launch_config(env_of(torchrun_env())).bind_cores);
  auto values = torchrun_env();
  values["TORCHPAR_BIND_CORES"] = "1";
  CHECK(read_launch_config(env_of(values)).bind_cores);
  values["TORCHPAR_BIND_CORES"] = "0";
  CHECK_FALSE(read_launch_config(env_of(values)).bind_cores);
  values["TORCHPAR_BIND_CORES"] = "yes";
  CHECK_THAT(launch_error_of(values), Contains("TORCHPAR_BIND_CORES='yes' must be 1"));
}

TEST_CASE("every missing variable is named in one message with what to do", "[launch]") {
  const auto message = launch_error_of({});
  CHECK_THAT(message, Contains("environment variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"));
  CHECK_THAT(message, Contains("torchrun"));
  CHECK(message.find('\n') == std::string::npos);

  auto env = torchrun_env();
  env.erase("MASTER_PORT");
  CHECK_THAT(launch_error_of(env), Contains("environment variable MASTER_PORT is not set"));
}

TEST_CASE("inconsistent values are rejected with the values", "[launch]") {
  auto env = torchrun_env();
  env["WORLD_SIZE"] = "0";
  CHECK_THAT(launch_error_of(env), Contains("WORLD_SIZE=0 must be at least 1"));
  env = torchrun_env();
  env["RANK"] = "4";
  CHECK_THAT(launch_error_of(env), Contains("RANK=4 is out of range for WORLD_SIZE=4 (valid ranks: 0..3)"));
  env = torchrun_env();
  env["RANK"] = "-1";
  CHECK_THAT(launch_error_of(env), Contains("RANK=-1 is out of range"));
  env = torchrun_env();
  env["WORLD_SIZE"] = "two";
  CHECK_THAT(launch_error_of(env), Contains("WORLD_SIZE='two' is not an integer"));
  env = torchrun_env();
  env["RANK"] = "1x";
  CHECK_THAT(launch_error_of(env), Contains("RANK='1x' is not an integer"));
  env = torchrun_env();
  env["MASTER_PORT"] = "70000";
  CHECK_THAT(launch_error_of(env), Contains("MASTER_PORT=70000 is not a TCP port"));
  env = torchrun_env();
  env["LOCAL_RANK"] = "2";
  CHECK_THAT(launch_error_of(env), Contains("LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2"));
}

TEST_CASE("explicit rank, world size and store need no environment", "[launch]") {
  const auto config = read_launch_config(env_of({}), LaunchOverrides{2, 5, true});
  CHECK(config.rank == 2);
  CHECK(config.world_size == 5);
  CHECK(config.master_addr.empty());
  CHECK_THAT(launch_error_of({}, LaunchOverrides{5, 5, true}), Contains("RANK=5 is out of range for WORLD_SIZE=5"));
  CHECK_THAT(launch_error_of({}, LaunchOverrides{0, 2, false}),
             Contains("environment variables MASTER_ADDR, MASTER_PORT are not set"));
}
