#include <torchpar/ps/consistency.h>

#include <algorithm>
#include <limits>

namespace torchpar::ps {

ConsistencyEngine::ConsistencyEngine(Consistency model, int staleness, std::chrono::milliseconds timeout,
                                     int num_workers, Clock::time_point now)
    : model_(model),
      staleness_(staleness),
      timeout_(timeout),
      states_(num_workers, WorkerState::Active),
      last_heard_(num_workers, now) {}

int ConsistencyEngine::active_count() const {
  return static_cast<int>(std::count(states_.begin(), states_.end(), WorkerState::Active));
}

bool ConsistencyEngine::any_finished() const {
  return std::count(states_.begin(), states_.end(), WorkerState::Finished) > 0;
}

bool ConsistencyEngine::lose(int worker) {
  if (states_[worker] != WorkerState::Active) {
    return false;
  }
  states_[worker] = WorkerState::Lost;
  return true;
}

void ConsistencyEngine::contribute(int worker, Table& table, at::Tensor ids, at::Tensor grads,
                                   Clock::time_point now) const {
  const int64_t clock = table.pushes[worker]++;
  if (model_ != Consistency::BSP) {
    if (grads.numel() > 0) {
      table.apply_mean({ids}, {grads});
    }
    return;
  }
  auto& round = table.rounds[clock];
  if (round.contributions.empty()) {
    round.contributions.resize(num_workers());
    round.opened = now;
  }
  round.contributions[worker] = std::make_pair(ids.defined() ? ids.clone() : ids, grads.clone());
  round.count += 1;
}

bool ConsistencyEngine::apply_full_rounds(const Tables& tables, const std::function<void(Table&)>& applied) const {
  bool any = false;
  for (const auto& table : tables) {
    while (!table->rounds.empty() && table->rounds.begin()->first == table->applied) {
      auto& round = table->rounds.begin()->second;
      bool full = true;
      for (int w = 0; w < num_workers(); ++w) {
        full = full && !(states_[w] == WorkerState::Active && !round.contributions[w]);
      }
      if (!full) {
        break; // this table waits for a worker; the next ones may not
      }
      std::vector<at::Tensor> ids;
      std::vector<at::Tensor> grads;
      for (auto& contribution : round.contributions) {
        if (contribution) {
          ids.push_back(contribution->first);
          grads.push_back(contribution->second);
        }
      }
      table->apply_mean(ids, grads);
      table->rounds.erase(table->rounds.begin());
      table->applied += 1;
      any = true;
      applied(*table);
    }
  }
  return any;
}

bool ConsistencyEngine::ready(const Table& table, int64_t clock) const {
  switch (model_) {
    case Consistency::ASP: return true;
    case Consistency::BSP: return table.applied >= clock;
    case Consistency::SSP: return clock - slowest_clock(table) <= staleness_;
  }
  return true;
}

bool ConsistencyEngine::readable(const Request& request, const Tables& tables) const {
  const int64_t ahead = request.kind == MessageKind::PushPull ? 1 : 0;
  for (const auto& item : request.dense) {
    if (!ready(*tables[item.table], item.clock + ahead)) return false;
  }
  for (const auto& item : request.rows) {
    if (!ready(*tables[item.table], item.clock)) return false;
  }
  return true;
}

int64_t ConsistencyEngine::slowest_clock(const Table& table) const {
  int64_t slowest = std::numeric_limits<int64_t>::max();
  for (int w = 0; w < num_workers(); ++w) {
    if (states_[w] == WorkerState::Active) {
      slowest = std::min(slowest, table.pushes[w]);
    }
  }
  return slowest;
}

std::optional<int64_t> ConsistencyEngine::common_clock(const Tables& tables) const {
  int64_t clock = std::numeric_limits<int64_t>::max();
  for (const auto& table : tables) {
    if (*std::max_element(table->pushes.begin(), table->pushes.end()) > 0) {
      clock = std::min(clock, slowest_clock(*table));
    }
  }
  if (clock == std::numeric_limits<int64_t>::max()) {
    return std::nullopt;
  }
  return clock;
}

std::vector<Drop> ConsistencyEngine::late_workers(const Tables& tables, const std::vector<WaitingRead>& waiting,
                                                  Clock::time_point now) const {
  const std::string timeout = std::to_string(timeout_.count()) + " ms";
  std::vector<Drop> drops;
  if (model_ != Consistency::BSP) {
    // Without rounds, a silent worker holds things up only when the others wait for it: an SSP read
    // waiting for the slowest clock, or the service's end once every other worker is done. Then
    // silence past the timeout counts as lost (a worker that is merely idle meanwhile is not).
    const bool read_waits_too_long = std::any_of(waiting.begin(), waiting.end(), [&](const WaitingRead& read) {
      return now - read.since >= timeout_;
    });
    if (!read_waits_too_long && active_count() > 1) {
      return drops;
    }
    std::vector<bool> reading(num_workers(), false); // a worker whose read waits is quiet, not silent
    for (const auto& read : waiting) {
      reading[read.worker] = true;
    }
    for (int w = 0; w < num_workers(); ++w) {
      if (states_[w] == WorkerState::Active && !reading[w] && now - last_heard_[w] >= timeout_) {
        drops.push_back({w, "it sent nothing for longer than the timeout (" + timeout + ")" +
                                (read_waits_too_long ? " while other workers' reads waited for it" : "")});
      }
    }
    return drops;
  }
  for (const auto& table : tables) {
    if (table->rounds.empty() || table->rounds.begin()->first != table->applied) {
      continue;
    }
    const auto& round = table->rounds.begin()->second;
    if (now - round.opened < timeout_) {
      continue;
    }
    const std::string why = "it did not push clock " + std::to_string(table->applied) + " of table '" +
                            table->name() + "' within the timeout (" + timeout + ")";
    for (int w = 0; w < num_workers(); ++w) {
      if (states_[w] == WorkerState::Active && !round.contributions[w]) drops.push_back({w, why});
    }
    return drops; // dropping them changes the other tables' rounds too; the next look sees that
  }
  return drops;
}

void ConsistencyEngine::resume_restored(Table& table) const {
  if (model_ != Consistency::BSP) {
    return;
  }
  // A BSP checkpoint's rounds applied win over a lost worker's lower clock.
  const int64_t slowest = std::max(table.applied, *std::min_element(table.pushes.begin(), table.pushes.end()));
  table.applied = slowest;
  std::fill(table.pushes.begin(), table.pushes.end(), slowest);
}

} // namespace torchpar::ps
