#include <torchpar/common/peer_processes.h>

#include <unistd.h>

#include <chrono>
#include <functional>
#include <sstream>
#include <thread>

#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <torchpar/common/control_collectives.h>
#include <torchpar/common/error_message.h>
#include <torchpar/common/host_id.h>
#include <torchpar/common/process_state.h>

namespace torchpar {
namespace {

constexpr std::chrono::milliseconds kExitGrace{500};

} // namespace

PeerProcesses PeerProcesses::gather(c10d::ProcessGroup& group, c10::Device device) {
  const auto host = static_cast<int64_t>(std::hash<std::string>{}(host_id()));
  const auto namespace_id = static_cast<int64_t>(pid_namespace());
  const auto mine = at::tensor({host, namespace_id, static_cast<int64_t>(::getpid())}, at::kLong);
  PeerProcesses result;
  for (const auto& theirs : all_gather(group, mine, device)) {
    const auto* fields = theirs.data_ptr<int64_t>();
    result.peers_.push_back({fields[2], fields[0] == host && fields[1] == namespace_id});
  }
  return result;
}

std::string PeerProcesses::describe_lost() const {
  // A killed peer's connections close while it is still exiting: give its process a moment to end.
  const auto deadline = std::chrono::steady_clock::now() + kExitGrace;
  std::string lost;
  while ((lost = lost_now()).empty() && !peers_.empty() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return lost;
}

std::string PeerProcesses::lost_now() const {
  std::ostringstream text;
  for (size_t rank = 0; rank < peers_.size(); ++rank) {
    const auto& peer = peers_[rank];
    if (!peer.here || peer.pid == ::getpid()) {
      continue;
    }
    const auto state = process_state(static_cast<int>(peer.pid));
    if (state != ProcessState::Running) {
      text << (text.tellp() > 0 ? "; " : "") << "rank " << rank << " (process " << peer.pid << ") "
           << (state == ProcessState::Exited ? "has exited" : "is stopped");
    }
  }
  return text.str();
}

std::string PeerProcesses::explain(const std::string& message) const {
  const std::string lost = describe_lost();
  return lost.empty() ? message : message + " [" + lost + "]";
}

void PeerProcesses::rethrow_naming_lost() const {
  const std::string lost = describe_lost();
  if (lost.empty()) {
    throw;
  }
  try {
    throw;
  } catch (const std::exception& error) {
    TORCH_CHECK(false, message_of(error), " [", lost, "]");
  }
}

} // namespace torchpar
