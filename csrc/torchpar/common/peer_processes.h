// Which process is which rank, so that an error after a peer died or froze can say which rank it was:
// Gloo's own message names only a connection ("Connection closed by peer [127.0.0.1]:4711").
#pragma once
#include <torchpar/common/c10d_fwd.h>

#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torchpar {

class PeerProcesses {
 public:
  PeerProcesses() = default;
  // Every rank's host and process id. Collective.
  static PeerProcesses gather(c10d::ProcessGroup& group, c10::Device device);

  // The ranks on this host whose process has exited or is stopped, as one clause for an error
  // message ("rank 2 (process 4711) has exited"); empty when none is (after waiting up to half a
  // second for one to finish exiting), or nothing was gathered.
  std::string describe_lost() const;
  // `message`, followed by what describe_lost finds.
  std::string explain(const std::string& message) const;
  // Inside a catch block: rethrows the exception being handled, as a c10::Error with describe_lost's
  // clause added when a peer was lost, unchanged otherwise.
  [[noreturn]] void rethrow_naming_lost() const;

 private:
  std::string lost_now() const;

  struct Peer {
    int64_t pid = 0;
    bool here = false; // same host and PID namespace as this process: its pid can be checked
  };
  std::vector<Peer> peers_;
};

} // namespace torchpar
