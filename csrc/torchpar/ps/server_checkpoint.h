#pragma once
// What a parameter server checkpoints and when. A checkpoint holds every table's values, optimizer
// state and clocks (each worker's pushes, the BSP rounds applied); it is written when every active
// worker asks, every `every` clocks (BSP: once every table applied that round; ASP / SSP: once the
// slowest worker passed the next multiple), and at a clean end; it is read when the server starts.
// The file itself is checkpoint_file's.
#include <torchpar/ps/config.h>
#include <torchpar/ps/table.h>

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace torchpar::ps {

class ServerCheckpoint {
 public:
  // `directory` empty: no checkpoints, nothing restored. `every`: clocks between periodic
  // checkpoints; 0: on request and at the end only. Reads this server's file when the directory holds
  // one and throws when it is not this job's.
  ServerCheckpoint(std::string directory, int64_t every, int server, int num_servers, int num_workers,
                   Consistency consistency, std::function<void(const std::string&)> info);

  bool enabled() const { return !directory_.empty(); }
  // Whether the restored checkpoint holds `table`.
  bool holds(const std::string& table) const { return restored_.count(table) > 0; }
  // Restores `table` when the checkpoint holds it; false when it does not.
  bool restore(Table& table) const;

  // Writes the tables as they are now; `why` goes into the log line.
  void write(const Tables& tables, const std::string& why);
  // BSP: `table` has just applied a round; writes when every table got to a periodic one.
  void round_applied(const Table& table, const Tables& tables);
  // ASP / SSP: every active worker reached `clock` (ConsistencyEngine::common_clock).
  void clock_reached(std::optional<int64_t> clock, const Tables& tables);
  // Only a clean end is worth a checkpoint: when every worker was lost (a crash, a dead server), the
  // last periodic or requested checkpoint is the one all servers agree on.
  bool due_at_end(const Tables& tables, bool some_worker_finished) const {
    return enabled() && !tables.empty() && some_worker_finished;
  }

 private:
  void write_state(const std::vector<c10::IValue>& tables, const std::string& why);

  std::string directory_;
  int64_t every_;
  int server_;
  int num_servers_;
  int num_workers_;
  Consistency consistency_;
  std::function<void(const std::string&)> info_;
  std::map<std::string, c10::impl::GenericDict> restored_;
  std::map<int64_t, std::map<std::string, c10::IValue>> periodic_snapshots_; // BSP: clock -> table -> state
  int64_t next_periodic_clock_ = 0;                                          // ASP / SSP
};

} // namespace torchpar::ps
