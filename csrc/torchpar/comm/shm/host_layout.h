#pragma once
#include <vector>

#include <torchpar/common/c10d_fwd.h>

namespace torchpar::comm::shm {

// Which ranks of a group share a host: shared memory serves within a host, Gloo between hosts.
struct HostLayout {
  int rank = 0;
  int host = 0; // index of this rank's host, hosts numbered by their lowest rank
  std::vector<int> host_of_rank;
  std::vector<std::vector<int>> ranks_on_host; // ascending global ranks

  int host_count() const {
    return static_cast<int>(ranks_on_host.size());
  }
  const std::vector<int>& local_ranks() const {
    return ranks_on_host[host];
  }
  int local_index_of(int global_rank) const;
  int local_rank() const {
    return local_index_of(rank);
  }
  bool leader() const {
    return local_ranks().front() == rank;
  }
};

// Every rank publishes its host id through the store and reads everyone else's.
HostLayout discover_hosts(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size);

} // namespace torchpar::comm::shm
