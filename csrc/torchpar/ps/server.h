#pragma once
// A parameter server: holds its shard of every table, answers workers' requests, applies their
// gradients through the tables' optimizers under the chosen consistency model, checkpoints, and
// keeps serving while workers come and go (a worker that dies is dropped; one that finishes is
// let go). Each channel's receiving thread handles its worker's requests under the server's one
// lock; the calling thread keeps the timers (statistics, BSP drops).
#include <torchpar/ps/config.h>

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
}

namespace torchpar::ps {

struct ServerOptions {
  Consistency consistency = Consistency::BSP;
  int staleness = 0; // SSP's bound s
  std::string checkpoint_dir; // empty: no checkpoints, nothing restored
  int64_t checkpoint_every = 0; // clocks between periodic checkpoints; 0: on request and at the end only
  // BSP: a round a live worker has not pushed to within this long drops that worker.
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  std::chrono::milliseconds stats_interval = std::chrono::seconds(30);
  // Where the server's log lines go; unset: c10 logging (LOG(INFO) / LOG(WARNING)).
  std::function<void(bool warning, const std::string& line)> log;
};

struct TableSummary {
  std::string name;
  bool sparse = false;
  int64_t rows_touched = 0; // sparse tables
  int64_t bytes = 0;        // values and optimizer state held by this server
};

struct ServerSummary {
  int64_t requests = 0;
  int64_t bytes_in = 0;
  int64_t bytes_out = 0;
  int64_t max_staleness = 0; // the most clocks a worker's read trailed its own clock
  int64_t reads_in_place = 0; // dense shards' values lent to a same-host reader rather than copied (shared_values.h)
  std::vector<int> lost_workers;
  std::vector<TableSummary> tables;
};

// Serves on `group` (ranks: the job's) for the workers at `worker_ranks` until every one has
// finished or been lost. Restores from `options.checkpoint_dir` when it holds this server's file.
ServerSummary run_server(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int server_index, int num_servers,
                         const std::vector<int>& worker_ranks, const ServerOptions& options);

} // namespace torchpar::ps
