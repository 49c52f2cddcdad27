#include "harness.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

#include "catch_with_torch.h"
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torchpar/comm/process_group.h>

namespace torchpar::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kOutputTailLines = 40;
// After the first rank fails, the others get this long to report their own failure before they
// are killed (they are usually blocked in a collective with the failed rank).
constexpr std::chrono::milliseconds kGraceAfterFailure{1000};

// A listening socket on a free loopback port, created before forking and handed to rank 0's
// TCPStore, so no other process can take the port in between.
int listen_on_free_port(std::uint16_t& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  REQUIRE(::listen(fd, 128) == 0);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  port = ntohs(address.sin_port);
  return fd;
}

std::string output_tail(const std::string& path) {
  std::ifstream file(path);
  std::deque<std::string> lines;
  for (std::string line; std::getline(file, line);) {
    lines.push_back(line);
    if (lines.size() > kOutputTailLines) {
      lines.pop_front();
    }
  }
  std::ostringstream text;
  for (const auto& line : lines) {
    text << "    | " << line << "\n";
  }
  return text.str();
}

std::string describe_exit(int status) {
  if (WIFEXITED(status)) {
    return "exited with code " + std::to_string(WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) {
    return std::string("was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
        strsignal(WTERMSIG(status)) + ")";
  }
  return "ended with status " + std::to_string(status);
}

// This rank's store, for leave_abruptly(); set in the child only.
c10d::Store* rank_store = nullptr;

// The child side: join the group, run the body, leave through _exit so that nothing of the
// parent's state (Catch2 session, static destructors) runs twice.
[[noreturn]] void run_rank(
    int rank,
    int world,
    int listen_fd,
    std::uint16_t port,
    int output_fd,
    const RankBody& body,
    const RankOptions& options) {
  ::dup2(output_fd, STDOUT_FILENO);
  ::dup2(output_fd, STDERR_FILENO);
  int code = 1;
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = port;
    store_options.isServer = rank == 0;
    store_options.numWorkers = world;
    store_options.waitWorkers = false;
    store_options.timeout = options.collective_timeout;
    if (rank == 0) {
      store_options.masterListenFd = listen_fd;
    }
    auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_options);
    rank_store = store.get();
    auto pg = torchpar::init_process_group(torchpar::InitOptions()
                                               .backend(options.backend)
                                               .timeout(options.collective_timeout)
                                               .rank(rank)
                                               .world_size(world)
                                               .store(store));
    const int failed_before = failed_assertions();
    body(rank, world, pg);
    const int failed = failed_assertions() - failed_before;
    if (failed == 0) {
      code = 0;
    } else {
      std::cerr << "rank " << rank << ": " << failed << " assertion(s) failed (see above)\n";
    }
    // Rank 0 hosts the store: it leaves last, so no rank loses the store while still using it.
    store->add("harness/finished", 1);
    if (rank == 0) {
      while (store->add("harness/finished", 0) < world) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  } catch (const Catch::TestFailureException&) {
    std::cerr << "rank " << rank << ": a REQUIRE failed (see above)\n";
  } catch (const std::exception& e) {
    std::cerr << "rank " << rank << " threw: " << e.what() << "\n";
  } catch (...) {
    std::cerr << "rank " << rank << " threw an exception of unknown type\n";
  }
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
#if defined(__SANITIZE_ADDRESS__)
  // _exit skips LeakSanitizer's check at exit, and the ranks are where torchpar's code runs.
  if (__lsan_do_recoverable_leak_check() != 0) {
    code = 1;
  }
#endif
  ::_exit(code);
}

} // namespace

std::vector<RankOutcome> launch_ranks(int world, const RankBody& body, const RankOptions& options) {
  REQUIRE(world >= 1);
  std::uint16_t port = 0;
  const int listen_fd = listen_on_free_port(port);
  std::vector<pid_t> pids(world, -1);
  std::vector<std::string> logs(world);
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  // scripts/sanitize.sh's self-checks read a rank's whole output there: a report must not depend on
  // the tail kept in a failure's message, nor on how Catch wraps it.
  const char* kept_output_dir = std::getenv("TORCHPAR_TEST_KEEP_RANK_OUTPUT");
  for (int rank = 0; rank < world; ++rank) {
    std::string path_template =
        std::string(kept_output_dir ? kept_output_dir : "/tmp") + "/torchpar-rank-XXXXXX";
    const int output_fd = ::mkstemp(path_template.data());
    REQUIRE(output_fd >= 0);
    logs[rank] = path_template;
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      run_rank(rank, world, listen_fd, port, output_fd, body, options);
    }
    ::close(output_fd);
    pids[rank] = pid;
  }
  ::close(listen_fd);

  std::vector<RankOutcome> outcomes(world);
  std::vector<bool> running(world, true);
  int still_running = world;
  const auto deadline = Clock::now() + options.deadline;
  std::optional<Clock::time_point> kill_at;
  std::string first_failure;
  while (still_running > 0) {
    for (int rank = 0; rank < world; ++rank) {
      int status = 0;
      if (running[rank] && ::waitpid(pids[rank], &status, WNOHANG) == pids[rank]) {
        running[rank] = false;
        --still_running;
        outcomes[rank] = {rank, WIFEXITED(status) && WEXITSTATUS(status) == 0,
                          "rank " + std::to_string(rank) + " " + describe_exit(status)};
        if (!outcomes[rank].passed && !kill_at) {
          kill_at = Clock::now() + kGraceAfterFailure;
          first_failure = "rank " + std::to_string(rank);
        }
      }
    }
    const auto now = Clock::now();
    const bool past_deadline = now >= deadline;
    if (still_running > 0 && (past_deadline || (kill_at && now >= *kill_at))) {
      for (int rank = 0; rank < world; ++rank) {
        if (running[rank]) {
          ::kill(pids[rank], SIGKILL);
          ::waitpid(pids[rank], nullptr, 0);
          running[rank] = false;
          --still_running;
          const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(options.deadline).count();
          outcomes[rank] = {rank, false,
                            "rank " + std::to_string(rank) +
                                (past_deadline ? " was still running at the deadline of " +
                                         std::to_string(seconds) + " s (hung?) and was killed"
                                               : " was killed after " + first_failure + " failed")};
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int rank = 0; rank < world; ++rank) {
    if (!outcomes[rank].passed) {
      outcomes[rank].message += "; its output ended with:\n" + output_tail(logs[rank]);
    }
    if (!kept_output_dir) {
      ::unlink(logs[rank].c_str());
    }
  }
  return outcomes;
}

void leave_abruptly() {
  TORCH_CHECK(rank_store, "leave_abruptly() is for a rank's body, under run_on_ranks");
  rank_store->add("harness/finished", 1);
  std::fflush(nullptr);
  ::_exit(0);
}

void run_on_ranks(int world, const RankBody& body, const RankOptions& options) {
  std::ostringstream failures;
  for (const auto& outcome : launch_ranks(world, body, options)) {
    if (!outcome.passed) {
      failures << outcome.message << "\n";
    }
  }
  if (!failures.str().empty()) {
    FAIL("on " << world << " ranks (backend " << options.backend << "):\n" << failures.str());
  }
}

} // namespace torchpar::testing
