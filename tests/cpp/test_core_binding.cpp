// Which cores each local rank gets (pure), and that binding this process pins it.
#include "catch_with_torch.h"

#include <torchpar/comm/core_binding.h>

#include <ATen/Parallel.h>

#include <sched.h>

#include <set>
#include <utility>

using torchpar::comm::core_share;
using torchpar::comm::LogicalCpu;

namespace {

// `cores` physical cores with `siblings` logical CPUs each, numbered as Linux does (the first sibling of every
// core, then the second ...).
std::vector<LogicalCpu> host(int cores, int siblings = 1) {
  std::vector<LogicalCpu> cpus;
  for (int sibling = 0; sibling < siblings; ++sibling) {
    for (int core = 0; core < cores; ++core) cpus.push_back({sibling * cores + core, 0, core});
  }
  return cpus;
}

} // namespace

TEST_CASE("bind_cores: ranks get disjoint blocks of whole physical cores that cover the host") {
  CHECK(core_share(host(2), 0, 2).cpus == std::vector<int>{0});
  CHECK(core_share(host(2), 1, 2).cpus == std::vector<int>{1});
  // SMT: a rank gets both siblings of its cores and one thread per physical core.
  const auto first = core_share(host(4, 2), 0, 2), second = core_share(host(4, 2), 1, 2);
  CHECK(first.cpus == std::vector<int>{0, 1, 4, 5});
  CHECK(second.cpus == std::vector<int>{2, 3, 6, 7});
  CHECK(first.threads == 2);
  // Uneven: 3 ranks over 4 cores, every core used once.
  std::multiset<int> used;
  for (int rank = 0; rank < 3; ++rank) {
    for (int cpu : core_share(host(4), rank, 3).cpus) used.insert(cpu);
  }
  CHECK(used == std::multiset<int>{0, 1, 2, 3});
  // The order the CPUs are listed in does not matter; two packages are two sets of cores.
  std::vector<LogicalCpu> packages{{3, 1, 0}, {0, 0, 0}, {2, 1, 1}, {1, 0, 1}};
  CHECK(core_share(packages, 1, 2).cpus == std::vector<int>{2, 3});
}

TEST_CASE("bind_cores: more local ranks than physical cores are not pinned") {
  const auto share = core_share(host(2, 2), 3, 4);
  CHECK_FALSE(share.pinned);
  CHECK(share.cpus == std::vector<int>{0, 1, 2, 3});
  CHECK(core_share(host(2, 2), 1, 2).pinned);
}

TEST_CASE("bind_cores: a rank outside the local world or no CPU at all is an error") {
  CHECK_THROWS_WITH(core_share(host(2), 2, 2), Catch::Contains("local rank 2 is out of range for 2 local ranks"));
  CHECK_THROWS_WITH(core_share({}, 0, 1), Catch::Contains("may run on no CPU"));
}

TEST_CASE("bind_cores: this process ends up on its share, with that many intra-op threads") {
  cpu_set_t before;
  REQUIRE(sched_getaffinity(0, sizeof(before), &before) == 0);
  const int threads_before = at::get_num_threads();
  const auto available = torchpar::comm::available_cpus();
  // One local rank per physical core (not per logical CPU: SMT siblings would leave them all unpinned).
  std::set<std::pair<int, int>> physical;
  for (const auto& cpu : available) physical.insert({cpu.package, cpu.core});
  const int last = static_cast<int>(physical.size()) - 1;
  const auto share = torchpar::bind_cores(last, last + 1);
  REQUIRE(share.pinned);
  cpu_set_t after;
  REQUIRE(sched_getaffinity(0, sizeof(after), &after) == 0);
  std::vector<int> allowed;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &after)) allowed.push_back(cpu);
  }
  CHECK(allowed == share.cpus);
  CHECK(at::get_num_threads() == share.threads);
  // Binding again sees the host's CPUs, not the share it was pinned to.
  CHECK(torchpar::comm::available_cpus().size() == available.size());
  sched_setaffinity(0, sizeof(before), &before);
  at::set_num_threads(threads_before);
}
