#include <torchpar/ps/server_checkpoint.h>

#include <torchpar/ps/checkpoint_file.h>
#include <torchpar/ps/wire_format.h>

#include <c10/util/Exception.h>

namespace torchpar::ps {

ServerCheckpoint::ServerCheckpoint(std::string directory, int64_t every, int server, int num_servers,
                                   int num_workers, Consistency consistency,
                                   std::function<void(const std::string&)> info)
    : directory_(std::move(directory)),
      every_(every),
      server_(server),
      num_servers_(num_servers),
      num_workers_(num_workers),
      consistency_(consistency),
      info_(std::move(info)) {
  if (!enabled()) {
    return;
  }
  const auto path = checkpoint_path(directory_, server_, num_servers_);
  const auto saved = read_checkpoint_file(path);
  if (!saved) {
    return;
  }
  const auto state = saved->toGenericDict();
  TORCH_CHECK(state.contains("format") && state.at("format").toStringRef() == "torchpar.ps",
              "torchpar.ps: ", path, " is not a parameter-server checkpoint");
  TORCH_CHECK(state.at("workers").toInt() == num_workers_, "torchpar.ps: checkpoint ", path, " was written for ",
              state.at("workers").toInt(), " workers, this job has ", num_workers_);
  for (const auto& table : state.at("tables").toList()) {
    auto entry = table.get().toGenericDict();
    restored_.emplace(entry.at("name").toStringRef(), entry);
  }
  info_("restoring " + std::to_string(restored_.size()) + " tables from " + path);
}

bool ServerCheckpoint::restore(Table& table) const {
  const auto saved = restored_.find(table.name());
  if (saved == restored_.end()) {
    return false;
  }
  table.restore(saved->second);
  return true;
}

void ServerCheckpoint::write(const Tables& tables, const std::string& why) {
  std::vector<c10::IValue> states;
  for (const auto& table : tables) {
    states.emplace_back(table->snapshot());
  }
  write_state(states, why);
}

void ServerCheckpoint::round_applied(const Table& table, const Tables& tables) {
  if (every_ <= 0 || table.applied % every_ != 0 || !enabled()) {
    return;
  }
  // The table as of this round: every worker's clock is the round's, whatever some already pushed
  // for the next one (those pushes are made again after a restart).
  auto state = table.snapshot();
  state.insert_or_assign("pushes", c10::IValue(std::vector<int64_t>(num_workers_, table.applied)));
  auto& snapshots = periodic_snapshots_[table.applied];
  snapshots[table.name()] = state;
  // Tables nobody pushes to (read-only) have no rounds: their current state is their state at any clock.
  size_t expected = 0;
  for (const auto& t : tables) {
    if (t->applied > 0 || !t->rounds.empty()) {
      ++expected;
    } else {
      snapshots.emplace(t->name(), t->snapshot());
    }
  }
  if (snapshots.size() >= tables.size() && expected > 0) {
    std::vector<c10::IValue> states;
    for (const auto& t : tables) {
      states.push_back(snapshots.at(t->name()));
    }
    const int64_t clock = table.applied;
    periodic_snapshots_.erase(periodic_snapshots_.begin(), periodic_snapshots_.upper_bound(clock));
    write_state(states, "at clock " + std::to_string(clock));
  }
}

void ServerCheckpoint::clock_reached(std::optional<int64_t> clock, const Tables& tables) {
  if (every_ <= 0 || !enabled() || !clock || *clock < next_periodic_clock_ + every_) {
    return;
  }
  write(tables, "at clock " + std::to_string(*clock));
  next_periodic_clock_ = *clock / every_ * every_;
}

void ServerCheckpoint::write_state(const std::vector<c10::IValue>& tables, const std::string& why) {
  c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
  state.insert("format", "torchpar.ps");
  state.insert("version", kWireVersion);
  state.insert("server", server_);
  state.insert("servers", num_servers_);
  state.insert("workers", num_workers_);
  state.insert("consistency", consistency_name(consistency_));
  c10::impl::GenericList list(c10::AnyType::get());
  for (const auto& table : tables) {
    list.push_back(table);
  }
  state.insert("tables", list);
  const auto path = checkpoint_path(directory_, server_, num_servers_);
  write_checkpoint_file(path, state);
  info_("checkpoint " + why + " written to " + path);
}

} // namespace torchpar::ps
