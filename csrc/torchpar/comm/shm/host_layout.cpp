#include <torchpar/comm/shm/host_layout.h>

#include <algorithm>
#include <map>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <torchpar/common/host_id.h>

namespace torchpar::comm::shm {

int HostLayout::local_index_of(int global_rank) const {
  const auto& ranks = ranks_on_host[host_of_rank[global_rank]];
  return static_cast<int>(std::find(ranks.begin(), ranks.end(), global_rank) - ranks.begin());
}

HostLayout discover_hosts(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size) {
  const std::string mine = host_id();
  store->set("shm/host/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  HostLayout layout;
  layout.rank = rank;
  std::map<std::string, int> host_index;
  for (int other = 0; other < size; ++other) {
    const auto value = store->get("shm/host/" + std::to_string(other));
    const auto [entry, added] = host_index.emplace(std::string(value.begin(), value.end()), layout.host_count());
    if (added) {
      layout.ranks_on_host.emplace_back();
    }
    layout.host_of_rank.push_back(entry->second);
    layout.ranks_on_host[entry->second].push_back(other);
  }
  layout.host = layout.host_of_rank[rank];
  return layout;
}

} // namespace torchpar::comm::shm
