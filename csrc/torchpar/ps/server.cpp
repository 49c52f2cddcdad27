#include <torchpar/ps/server.h>

#include <torchpar/common/error_message.h>

#include <torchpar/ps/channel.h>
#include <torchpar/ps/consistency.h>
#include <torchpar/ps/dense_table.h>
#include <torchpar/ps/messages.h>
#include <torchpar/ps/request_checks.h>
#include <torchpar/ps/server_checkpoint.h>
#include <torchpar/ps/shared_values.h>
#include <torchpar/ps/sparse_table.h>

#include <ATen/ops/from_blob.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <condition_variable>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <sstream>

namespace torchpar::ps {
namespace {

using Clock = std::chrono::steady_clock;

// Shards from this size on keep their values where same-host workers read them in place
// (shared_values.h): the copy a reply would make costs more than the hand-back's futex call.
constexpr int64_t kSharedValuesFromBytes = int64_t{256} << 10;

ServerOptions with_default_log(ServerOptions options) {
  if (!options.log) {
    options.log = [](bool warning, const std::string& line) {
      if (warning) {
        LOG(WARNING) << line;
      } else {
        LOG(INFO) << line;
      }
    };
  }
  return options;
}

struct Event {
  int worker = 0;
  Message message;
  std::string failure; // non-empty: the worker's connection broke
};

// A request whose reads wait for other workers (BSP: the round; SSP: the slowest worker).
struct Deferred {
  int worker = 0;
  int64_t id = 0;
  Request request;
  at::Tensor payload; // keeps the request's data alive
  std::chrono::steady_clock::time_point since = std::chrono::steady_clock::now();
};

class Server {
 public:
  Server(c10::intrusive_ptr<c10d::ProcessGroup> group, int index, int num_servers, std::vector<int> worker_ranks,
         ServerOptions options)
      : group_(std::move(group)),
        index_(index),
        num_servers_(num_servers),
        worker_ranks_(std::move(worker_ranks)),
        options_(with_default_log(std::move(options))),
        consistency_(options_.consistency, options_.staleness, options_.timeout, num_workers(), Clock::now()),
        checkpoint_(options_.checkpoint_dir, options_.checkpoint_every, index_, num_servers_, num_workers(),
                    options_.consistency, [this](const std::string& line) { info(line); }),
        checkpoint_requests_(worker_ranks_.size(), -1) {}

  ServerSummary run();

 private:
  int num_workers() const { return static_cast<int>(worker_ranks_.size()); }
  std::string who(int worker) const {
    return "worker " + std::to_string(worker) + " (rank " + std::to_string(worker_ranks_[worker]) + ")";
  }
  std::string prefix() const { return "torchpar.ps server " + std::to_string(index_) + ": "; }
  void info(const std::string& line) { options_.log(false, prefix() + line); }
  void warn(const std::string& line) { options_.log(true, prefix() + line); }

  void handle(Event&& event);
  void handle_message(int worker, Message&& message);
  void dispatch(int worker, const Frame& frame, Request&& request, at::Tensor payload);
  void register_dense(int worker, int64_t id, const DenseRegistration& registration);
  // A new shard: its values lent to readers in place (`shared`) where workers can map them, else private.
  std::unique_ptr<DenseTable> make_dense_table(const DenseRegistration& registration,
                                               std::shared_ptr<SharedValues>* shared);
  void register_sparse(int worker, int64_t id, const SparseRegistration& registration);
  void answer_registration(int worker, int64_t id, const std::string& name);
  // Restored from the checkpoint when it holds the table.
  void add_table(std::unique_ptr<Table> table, const std::string& description);
  void apply_pushes(int worker, const Request& request);
  void answer_reads(int worker, int64_t id, const Request& request);
  void progress();
  void advance();
  void finish_checkpoint_requests();
  void lose(int worker, const std::string& reason);
  void refuse_waiting(int worker, const std::string& reason);
  void drop_late_workers();
  void log_stats();

  Table& table(uint32_t id);

  void send(int worker, Message message);
  void reply_ok(int worker, int64_t id, WireWriter payload = {});
  void reply_error(int worker, int64_t id, const std::string& reason);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int index_;
  int num_servers_;
  std::vector<int> worker_ranks_;
  ServerOptions options_;
  ConsistencyEngine consistency_;
  ServerCheckpoint checkpoint_;

  Tables tables_;
  std::map<std::string, uint32_t> table_ids_;
  std::map<uint32_t, std::shared_ptr<SharedValues>> shared_values_; // by table id
  struct WaitingRegistration {
    int worker;
    int64_t id;
    DenseRegistration registration;
  };
  std::map<std::string, std::vector<WaitingRegistration>> waiting_registrations_; // before worker 0's
  std::list<Deferred> deferred_;
  std::vector<int64_t> checkpoint_requests_; // per worker: the id of its waiting request, or -1

  // Channels' receiver threads handle their messages under this lock, the main loop its timers.
  std::mutex mutex_;
  std::condition_variable changed_;
  bool closing_ = false;
  std::vector<std::unique_ptr<Channel>> channels_;

  ServerSummary summary_;
  int64_t requests_at_last_stats_ = 0;
  int64_t bytes_in_at_last_stats_ = 0;
  int64_t bytes_out_at_last_stats_ = 0;
  Clock::time_point last_stats_ = Clock::now();
};

Table& Server::table(uint32_t id) {
  return table_by_id(tables_, id, index_);
}

void Server::send(int worker, Message message) {
  summary_.bytes_out += Frame::kFields * 8 + message.frame.payload_bytes;
  channels_[worker]->send(std::move(message));
}

void Server::reply_ok(int worker, int64_t id, WireWriter payload) {
  send(worker, make_message(MessageKind::Ok, id, std::move(payload)));
}

void Server::reply_error(int worker, int64_t id, const std::string& reason) {
  WireWriter writer;
  writer.put_string(reason);
  send(worker, make_message(MessageKind::Error, id, writer.release()));
}

ServerSummary Server::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (int w = 0; w < num_workers(); ++w) {
    consistency_.heard_from(w, Clock::now()); // silence counts from here
    auto deliver = [this](Event event) {
      {
        std::lock_guard<std::mutex> guard(mutex_);
        if (!closing_) handle(std::move(event));
      }
      changed_.notify_one();
    };
    channels_.push_back(std::make_unique<Channel>(
        group_, worker_ranks_[w], kReplyTag, kRequestTag,
        [w, deliver](Message&& message) {
          // Only a well-formed finish ends the worker's requests; a malformed one is refused like any other.
          const bool last = message.frame.kind == MessageKind::Finish && message.frame.payload_bytes == 0;
          deliver(Event{w, std::move(message), {}});
          return !last;
        },
        [w, deliver](const std::string& reason) { deliver(Event{w, {}, reason}); }, Channel::default_ring_bytes(),
        // Handled inside the callback; the one request kept past it (a read that waits) copies its payload.
        RingPayloads::Lent));
  }
  info(std::string("serving ") + std::to_string(num_workers()) + " workers, " +
       consistency_name(options_.consistency) +
       (options_.consistency == Consistency::SSP ? " (staleness " + std::to_string(options_.staleness) + ")" : ""));
  auto next_stats = Clock::now() + options_.stats_interval;
  while (consistency_.any_active()) {
    changed_.wait_for(lock, std::chrono::milliseconds(100));
    drop_late_workers();
    if (Clock::now() >= next_stats) {
      log_stats();
      next_stats = Clock::now() + options_.stats_interval;
    }
  }
  if (checkpoint_.due_at_end(tables_, consistency_.any_finished())) {
    try {
      checkpoint_.write(tables_, "at the end");
    } catch (const std::exception& error) {
      warn(std::string("the final checkpoint failed: ") + message_of(error));
    }
  }
  log_stats();
  for (const auto& table : tables_) {
    const auto* sparse = dynamic_cast<const SparseTable*>(table.get());
    summary_.tables.push_back({table->name(), table->is_sparse(), sparse ? sparse->touched_rows() : 0, table->bytes()});
  }
  closing_ = true;
  auto channels = std::move(channels_);
  lock.unlock();
  channels.clear(); // waits for the last replies to be received
  return summary_;
}

void Server::handle(Event&& event) {
  if (!event.failure.empty()) {
    lose(event.worker, "its connection broke: " + event.failure);
    return;
  }
  handle_message(event.worker, std::move(event.message));
}

void Server::handle_message(int worker, Message&& message) {
  const Frame frame = message.frame;
  consistency_.heard_from(worker, Clock::now());
  summary_.requests += 1;
  summary_.bytes_in += Frame::kFields * 8 + frame.payload_bytes;
  if (consistency_.state(worker) == WorkerState::Lost) {
    if (frame.kind == MessageKind::Finish) {
      send(worker, make_message(MessageKind::Bye, frame.request_id));
    } else {
      reply_error(worker, frame.request_id,
                  "torchpar.ps: " + who(worker) + " was dropped by server " + std::to_string(index_) +
                      " (it was silent for longer than the timeout); its requests are refused");
    }
    return;
  }
  Request request;
  try {
    const auto* bytes = message.payload.defined() ? message.payload.data_ptr<uint8_t>() : nullptr;
    request = decode_request(frame.kind, bytes, static_cast<size_t>(frame.payload_bytes));
    dispatch(worker, frame, std::move(request), message.payload);
  } catch (const std::exception& error) {
    reply_error(worker, frame.request_id,
                std::string("torchpar.ps server ") + std::to_string(index_) + " refused " + kind_name(frame.kind) +
                    " request " + std::to_string(frame.request_id) + " of " + who(worker) + ": " +
                    message_of(error));
    return;
  }
  progress();
}

void Server::progress() {
  // Runs on a channel's thread: nothing may escape it (a periodic checkpoint failing to write, an
  // allocation failing) — logged, and the server goes on.
  try {
    advance();
  } catch (const std::exception& error) {
    warn(std::string("applying updates or writing a checkpoint failed: ") + message_of(error));
  }
}

void Server::dispatch(int worker, const Frame& frame, Request&& request, at::Tensor payload) {
  const int64_t id = frame.request_id;
  switch (frame.kind) {
    case MessageKind::RegisterDense:
      register_dense(worker, id, *request.dense_registration);
      return;
    case MessageKind::RegisterSparse:
      register_sparse(worker, id, *request.sparse_registration);
      return;
    case MessageKind::SetLearningRate: {
      check_learning_rate(request, tables_, index_);
      table(request.table).optimizer().lr = request.lr;
      reply_ok(worker, id);
      return;
    }
    case MessageKind::Checkpoint:
      TORCH_CHECK(checkpoint_.enabled(), "no checkpoint directory was given to the parameter service");
      checkpoint_requests_[worker] = id;
      return;
    case MessageKind::Finish:
      consistency_.finish(worker);
      refuse_waiting(worker, "torchpar.ps: " + who(worker) + " finished while this request waited");
      info(who(worker) + " finished; " + std::to_string(consistency_.active_count()) + " still training");
      send(worker, make_message(MessageKind::Bye, id));
      return;
    default:
      break;
  }
  check_items(request, tables_, worker, who(worker), index_);
  apply_pushes(worker, request);
  if (request.kind == MessageKind::Push || request.kind == MessageKind::PushRows) {
    reply_ok(worker, id);
  } else if (consistency_.readable(request, tables_)) {
    answer_reads(worker, id, request);
  } else {
    // It outlives this message, whose payload may be a view of the channel's ring: keep a copy of its own.
    auto owned = payload.defined() ? payload.clone() : payload;
    auto kept = decode_request(frame.kind, owned.defined() ? owned.const_data_ptr<uint8_t>() : nullptr,
                               static_cast<size_t>(frame.payload_bytes));
    deferred_.push_back(Deferred{worker, id, std::move(kept), std::move(owned)});
  }
}

void Server::apply_pushes(int worker, const Request& request) {
  if (request.kind == MessageKind::Push || request.kind == MessageKind::PushPull) {
    for (const auto& item : request.dense) {
      auto grads = at::from_blob(const_cast<uint8_t*>(item.data), {item.numel}, item.dtype);
      consistency_.contribute(worker, table(item.table), at::Tensor(), std::move(grads), Clock::now());
    }
  } else if (request.kind == MessageKind::PushRows) {
    for (const auto& item : request.rows) {
      auto ids = at::from_blob(const_cast<int64_t*>(item.ids), {item.count}, at::kLong);
      auto grads = at::from_blob(const_cast<uint8_t*>(item.data), {item.count, item.dim}, item.dtype);
      consistency_.contribute(worker, table(item.table), std::move(ids), std::move(grads), Clock::now());
    }
  }
}

void Server::answer_reads(int worker, int64_t id, const Request& request) {
  // A shard the worker has mapped is lent, not sent. Otherwise the reply views the tables' values (and
  // the rows read): under this server's lock nothing changes them before reply_ok has sent them, so
  // they are copied once, straight into the channel's ring.
  WireWriter writer;
  std::vector<at::Tensor> rows_read;
  std::vector<SharedValues*> lent; // taken back if the reply does not go out
  try {
    const int64_t ahead = request.kind == MessageKind::PushPull ? 1 : 0;
    for (const auto& item : request.dense) {
      const auto& t = static_cast<const DenseTable&>(*tables_[item.table]);
      const int64_t slowest = consistency_.slowest_clock(t);
      if (slowest != std::numeric_limits<int64_t>::max()) {
        summary_.max_staleness = std::max(summary_.max_staleness, item.clock + ahead - slowest);
      }
      const auto shared = item.in_place ? shared_values_.find(item.table) : shared_values_.end();
      const uint64_t lending = shared != shared_values_.end() ? shared->second->lend(worker) : 0;
      writer.put<uint8_t>(lending != 0 ? 1 : 0);
      if (lending != 0) {
        writer.put<uint64_t>(lending);
        lent.push_back(shared->second.get());
      } else {
        writer.put_data_view(t.values().const_data_ptr(), t.values().nbytes());
      }
    }
    for (const auto& item : request.rows) {
      auto& t = static_cast<SparseTable&>(*tables_[item.table]);
      const int64_t slowest = consistency_.slowest_clock(t);
      if (slowest != std::numeric_limits<int64_t>::max()) {
        summary_.max_staleness = std::max(summary_.max_staleness, item.clock - slowest);
      }
      rows_read.push_back(t.read_rows(item.ids, item.count));
      writer.put_data_view(rows_read.back().const_data_ptr(), rows_read.back().nbytes());
    }
    reply_ok(worker, id, std::move(writer));
  } catch (...) {
    for (auto* values : lent) values->revoke(worker);
    throw;
  }
  summary_.reads_in_place += static_cast<int64_t>(lent.size());
}

void Server::advance() {
  if (options_.consistency == Consistency::BSP) {
    consistency_.apply_full_rounds(tables_, [this](Table& table) { checkpoint_.round_applied(table, tables_); });
  } else {
    checkpoint_.clock_reached(consistency_.common_clock(tables_), tables_);
  }
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    if (consistency_.state(it->worker) != WorkerState::Active) {
      it = deferred_.erase(it);
    } else if (consistency_.readable(it->request, tables_)) {
      answer_reads(it->worker, it->id, it->request);
      it = deferred_.erase(it);
    } else {
      ++it;
    }
  }
  finish_checkpoint_requests();
}

void Server::finish_checkpoint_requests() {
  bool all = consistency_.any_active();
  for (int w = 0; w < num_workers(); ++w) {
    if (consistency_.state(w) == WorkerState::Active && checkpoint_requests_[w] < 0) {
      all = false;
    }
  }
  if (!all) {
    return;
  }
  std::string failure;
  try {
    checkpoint_.write(tables_, "on request");
  } catch (const std::exception& error) {
    failure = message_of(error);
  }
  for (int w = 0; w < num_workers(); ++w) {
    if (checkpoint_requests_[w] >= 0) {
      if (failure.empty()) {
        reply_ok(w, checkpoint_requests_[w]);
      } else {
        reply_error(w, checkpoint_requests_[w], failure);
      }
      checkpoint_requests_[w] = -1;
    }
  }
}

void Server::lose(int worker, const std::string& reason) {
  if (!consistency_.lose(worker)) {
    return;
  }
  summary_.lost_workers.push_back(worker);
  for (auto& [table, values] : shared_values_) values->revoke(worker); // a dropped reader's reads fail
  warn(who(worker) + " lost: " + reason + "; continuing with " + std::to_string(consistency_.active_count()) +
       " workers");
  // A worker dropped while alive hears why its waiting requests end (a dead one's sends just fail).
  refuse_waiting(worker, "torchpar.ps: " + who(worker) + " was dropped by server " + std::to_string(index_) + ": " +
                             reason);
  progress();
}

void Server::refuse_waiting(int worker, const std::string& reason) {
  auto refuse_from = [&](auto& requests) {
    for (auto it = requests.begin(); it != requests.end();) {
      if (it->worker == worker) {
        reply_error(worker, it->id, reason);
        it = requests.erase(it);
      } else {
        ++it;
      }
    }
  };
  refuse_from(deferred_);
  for (auto& [name, waiters] : waiting_registrations_) {
    refuse_from(waiters);
  }
  if (checkpoint_requests_[worker] >= 0) {
    reply_error(worker, checkpoint_requests_[worker], reason);
    checkpoint_requests_[worker] = -1;
  }
}

void Server::drop_late_workers() {
  std::vector<WaitingRead> waiting;
  for (const auto& read : deferred_) {
    waiting.push_back({read.worker, read.since});
  }
  // Collected first: dropping a worker may complete a round and answer reads.
  for (const auto& drop : consistency_.late_workers(tables_, waiting, Clock::now())) {
    lose(drop.worker, drop.reason);
  }
}

void Server::register_dense(int worker, int64_t id, const DenseRegistration& registration) {
  auto existing = table_ids_.find(registration.name);
  if (existing == table_ids_.end() && worker != 0 && !checkpoint_.holds(registration.name)) {
    // Worker 0's values start the table; the others' registrations wait for them.
    DenseRegistration waiting = registration;
    waiting.initial = nullptr;
    waiting_registrations_[registration.name].push_back({worker, id, std::move(waiting)});
    return;
  }
  if (existing == table_ids_.end()) {
    std::shared_ptr<SharedValues> shared;
    add_table(make_dense_table(registration, &shared), "dense, " + registration.optimizer.describe());
    if (shared) shared_values_[table_ids_.at(registration.name)] = std::move(shared);
  }
  check_registration(*tables_[table_ids_.at(registration.name)], registration);
  answer_registration(worker, id, registration.name);
  auto waiting = waiting_registrations_.find(registration.name);
  if (waiting != waiting_registrations_.end()) {
    auto waiters = std::move(waiting->second);
    waiting_registrations_.erase(waiting);
    for (const auto& waiter : waiters) {
      try {
        check_registration(*tables_[table_ids_.at(registration.name)], waiter.registration);
        answer_registration(waiter.worker, waiter.id, registration.name);
      } catch (const std::exception& error) {
        reply_error(waiter.worker, waiter.id, "torchpar.ps server " + std::to_string(index_) + ": " + message_of(error));
      }
    }
  }
}

std::unique_ptr<DenseTable> Server::make_dense_table(const DenseRegistration& registration,
                                                     std::shared_ptr<SharedValues>* shared_values) {
  const int64_t numel = registration.shard_end - registration.shard_begin;
  const auto initial = at::from_blob(const_cast<uint8_t*>(registration.initial), {numel}, registration.dtype);
  std::shared_ptr<SharedValues> shared;
  if (static_cast<int64_t>(initial.nbytes()) >= kSharedValuesFromBytes && Channel::default_ring_bytes() > 0) {
    try {
      // Half the timeout: a reader late that long is taken back before the other workers' requests,
      // which wait behind this server's lock meanwhile, reach their own deadline.
      shared = std::make_shared<SharedValues>(
          numel, registration.dtype, num_workers(), options_.timeout / 2,
          [this, name = registration.name](int worker, const std::string& why) {
            warn(who(worker) + " lost the values of table '" + name + "' it was reading: " + why);
          });
    } catch (const std::exception& error) {
      warn("table '" + registration.name + "': its values are copied into every reply: " + message_of(error));
    }
  }
  if (!shared) {
    return std::make_unique<DenseTable>(registration.name, registration.shape, registration.shard_begin,
                                        registration.shard_end, initial.clone(), registration.optimizer,
                                        num_workers());
  }
  shared->values().copy_(initial);
  *shared_values = shared;
  // Runs under this server's lock: no lending starts while it waits for readers.
  auto before_change = [shared] { shared->wait_until_returned(); };
  return std::make_unique<DenseTable>(registration.name, registration.shape, registration.shard_begin,
                                      registration.shard_end, shared->values(), registration.optimizer, num_workers(),
                                      std::move(before_change));
}

void Server::add_table(std::unique_ptr<Table> table, const std::string& description) {
  const bool restored = checkpoint_.restore(*table);
  if (restored) {
    consistency_.resume_restored(*table);
  }
  info("table '" + table->name() + "' (" + description + ") " +
       (restored ? "restored from the checkpoint" : "created"));
  table_ids_[table->name()] = static_cast<uint32_t>(tables_.size());
  tables_.push_back(std::move(table));
}

void Server::register_sparse(int worker, int64_t id, const SparseRegistration& registration) {
  auto existing = table_ids_.find(registration.name);
  if (existing == table_ids_.end()) {
    add_table(std::make_unique<SparseTable>(registration.name, registration.dtype, registration.num_rows,
                                            registration.dim, registration.initializer, registration.optimizer,
                                            num_workers()),
              "sparse, " + std::to_string(registration.num_rows) + " rows of " + std::to_string(registration.dim) +
                  ", " + registration.optimizer.describe());
  }
  check_registration(*tables_[table_ids_.at(registration.name)], registration);
  answer_registration(worker, id, registration.name);
}

void Server::answer_registration(int worker, int64_t id, const std::string& name) {
  const uint32_t table = table_ids_.at(name);
  WireWriter writer;
  Registered registered{table, tables_[table]->pushes[worker], checkpoint_.holds(name), std::nullopt};
  const auto shared = shared_values_.find(table);
  if (shared != shared_values_.end()) registered.values = shared->second->offer();
  encode_registered(writer, registered);
  reply_ok(worker, id, std::move(writer));
}

void Server::log_stats() {
  const auto now = Clock::now();
  const double seconds = std::max(1e-9, std::chrono::duration<double>(now - last_stats_).count());
  std::ostringstream line;
  line.precision(3);
  line << (summary_.requests - requests_at_last_stats_) / seconds << " requests/s, in "
       << (summary_.bytes_in - bytes_in_at_last_stats_) / seconds / 1e6 << " MB/s, out "
       << (summary_.bytes_out - bytes_out_at_last_stats_) / seconds / 1e6 << " MB/s; worker clocks [";
  int64_t fastest = 0;
  int64_t slowest = std::numeric_limits<int64_t>::max();
  for (int w = 0; w < num_workers(); ++w) {
    int64_t clock = std::numeric_limits<int64_t>::max();
    for (const auto& table : tables_) {
      clock = std::min(clock, table->pushes[w]);
    }
    if (tables_.empty()) clock = 0;
    line << (w ? ", " : "");
    if (consistency_.state(w) == WorkerState::Active) {
      line << clock;
      fastest = std::max(fastest, clock);
      slowest = std::min(slowest, clock);
    } else {
      line << (consistency_.state(w) == WorkerState::Finished ? "done" : "lost");
    }
  }
  int64_t rows = 0;
  int64_t bytes = 0;
  for (const auto& table : tables_) {
    bytes += table->bytes();
    if (const auto* sparse = dynamic_cast<const SparseTable*>(table.get())) {
      rows += sparse->touched_rows();
    }
  }
  line << "]; staleness " << (slowest == std::numeric_limits<int64_t>::max() ? 0 : fastest - slowest)
       << " now, " << summary_.max_staleness << " at most; " << tables_.size() << " tables, " << rows
       << " sparse rows, " << bytes / 1e6 << " MB";
  info(line.str());
  requests_at_last_stats_ = summary_.requests;
  bytes_in_at_last_stats_ = summary_.bytes_in;
  bytes_out_at_last_stats_ = summary_.bytes_out;
  last_stats_ = now;
}

} // namespace

ServerSummary run_server(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int server_index, int num_servers,
                         const std::vector<int>& worker_ranks, const ServerOptions& options) {
  return Server(group, server_index, num_servers, worker_ranks, options).run();
}

} // namespace torchpar::ps
