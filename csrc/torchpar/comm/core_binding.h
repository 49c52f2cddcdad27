// Each local rank of a host pinned to its own share of the host's cores, as DeepSpeed's
// --bind_cores_to_rank and torch's xeon launcher do for CPU training. Measured on 2 cores: unpinned,
// the shm all-reduce's p90 stayed within 1.5x its median at 7-8 of 15 sizes and 4-64 KiB took 12-24 us;
// pinned, 13-15 of 15 and 11-16 us. With more local ranks than physical cores nothing is pinned: two
// ranks to a core halved the 4-rank all-reduce's small-message latency, but a parameter server whose
// server shared a worker's core (unequal loads) answered sparse pulls up to 1.5x slower than placed by
// the scheduler.
#pragma once
#include <optional>
#include <vector>

namespace torchpar::comm {

// A logical CPU this process may run on, with the physical core it belongs to.
struct LogicalCpu {
  int id = 0;
  int package = 0;
  int core = 0;
};

// What a local rank gets: its logical CPUs and the intra-op threads to run on them (one per
// physical core: SMT siblings share a core's arithmetic units).
struct CoreShare {
  std::vector<int> cpus;
  int threads = 1;
  bool pinned = true;  // false: more local ranks than physical cores, every CPU left to the scheduler
};

// Pure: the share of `available` for `local_rank` of `local_world_size`. With at least as many
// physical cores as local ranks, each rank gets a contiguous block of whole physical cores (the
// blocks cover them all); with fewer, every CPU, not pinned.
CoreShare core_share(std::vector<LogicalCpu> available, int local_rank, int local_world_size);

// The logical CPUs this process may run on (its affinity when first asked, so that a second call
// after binding still sees the host's), with their topology from /sys.
std::vector<LogicalCpu> available_cpus();

// Pins every thread of this process, and those it starts later, to this rank's share of
// available_cpus() and sets ATen's intra-op threads to the share's threads; with more local ranks than
// physical cores, changes nothing and warns. Returns the share. Unset, `local_rank` and
// `local_world_size` come from torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE (LaunchError when missing).
CoreShare bind_cores(std::optional<int> local_rank = std::nullopt, std::optional<int> local_world_size = std::nullopt);

} // namespace torchpar::comm

namespace torchpar {
using comm::bind_cores;
} // namespace torchpar
