#include <torchpar/comm/store.h>

#include <algorithm>
#include <sstream>
#include <thread>

#include <c10/util/Logging.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <torchpar/comm/launch_config.h>
#include <torchpar/comm/launch_error.h>

namespace torchpar::comm {
namespace {

std::string first_line(const std::string& text) {
  return text.substr(0, text.find('\n'));
}

// c10d logs a failed connection or wait at ERROR level, C++ backtrace included, and then throws;
// the LaunchError made from that exception says the same in one line. So while torchpar waits on
// the store, c10 logs only fatal messages.
class OnlyFatalLogs {
 public:
  OnlyFatalLogs() : saved_(FLAGS_caffe2_log_level) {
    FLAGS_caffe2_log_level = std::max(saved_, kFatalLevel);
  }
  ~OnlyFatalLogs() {
    FLAGS_caffe2_log_level = saved_;
  }
  OnlyFatalLogs(const OnlyFatalLogs&) = delete;
  OnlyFatalLogs& operator=(const OnlyFatalLogs&) = delete;

 private:
  static constexpr int kFatalLevel = 3; // c10's levels: INFO 0, WARNING 1, ERROR 2, FATAL 3
  int saved_;
};

constexpr std::chrono::milliseconds kJoinPollInterval{50};

std::string seconds(std::chrono::milliseconds timeout) {
  std::ostringstream text;
  text << std::chrono::duration<double>(timeout).count() << " s";
  return text.str();
}

} // namespace

c10::intrusive_ptr<c10d::Store> connect_store(
    const LaunchConfig& config,
    std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(config.master_port);
  options.isServer = !config.use_agent_store && config.rank == 0;
  options.numWorkers = config.world_size;
  // Joining is checked by wait_for_all_ranks, which can say how many ranks are missing.
  options.waitWorkers = false;
  options.timeout = timeout;
  options.multiTenant = true;
  const std::string where = config.master_addr + ":" + std::to_string(config.master_port);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    OnlyFatalLogs quiet;
    store = c10::make_intrusive<c10d::TCPStore>(config.master_addr, options);
  } catch (const c10::Error& e) {
    if (options.isServer) {
      throw LaunchError(
          "torchpar.init_process_group: rank 0 could not host the rendezvous store on " + where +
          " (" + first_line(e.what_without_backtrace()) +
          "); choose a free MASTER_PORT or stop the job that holds it");
    }
    throw LaunchError(
        "torchpar.init_process_group: rank " + std::to_string(config.rank) +
        " could not reach the rendezvous store at " + where + " within " + seconds(timeout) + " (" +
        first_line(e.what_without_backtrace()) + "); check that " +
        (config.use_agent_store ? "the torchrun agent" : "rank 0") +
        " is running and that MASTER_ADDR and MASTER_PORT are right");
  }
  return c10::make_intrusive<c10d::PrefixStore>(
      "torchpar/attempt_" + std::to_string(config.restart_count) + "/", store);
}

void wait_for_all_ranks(
    c10d::Store& store,
    int rank,
    int world_size,
    std::chrono::milliseconds timeout) {
  const std::string joined_key = "join/count";
  const std::string complete_key = "join/complete";
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int64_t joined = store.add(joined_key, 1);
  if (joined == world_size) {
    store.set(complete_key, std::vector<uint8_t>{1});
  }
  // Polled rather than one blocking wait, so that the count of ranks that joined is known even
  // when rank 0, which hosts the store, gives up first and takes the store with it.
  OnlyFatalLogs quiet;
  bool store_answers = true;
  while (std::chrono::steady_clock::now() < deadline) {
    try {
      if (store.check({complete_key})) {
        return;
      }
      joined = store.add(joined_key, 0);
    } catch (const c10::Error&) {
      store_answers = false;
      break;
    }
    std::this_thread::sleep_for(kJoinPollInterval);
  }
  const std::string counted = "torchpar.init_process_group: only " + std::to_string(joined) + " of " +
      std::to_string(world_size) + " ranks ";
  const std::string advice = " (this is rank " + std::to_string(rank) +
      "); check that every rank was started with the same WORLD_SIZE and that none crashed";
  if (!store_answers) {
    throw LaunchError(counted + "had joined when the rendezvous store stopped answering (its host, rank 0, " +
                      "gives up after " + seconds(timeout) + ")" + advice);
  }
  throw LaunchError(counted + "joined the process group within " + seconds(timeout) + advice);
}

} // namespace torchpar::comm
