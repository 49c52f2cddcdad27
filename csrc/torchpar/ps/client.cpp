#include <torchpar/ps/client.h>

#include <torchpar/common/error_message.h>
#include <torchpar/common/hash.h>
#include <torchpar/ps/messages.h>
#include <torchpar/ps/row_ids.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstring>

namespace torchpar::ps {
namespace {

const uint8_t* bytes_of(const at::Tensor& tensor) { return static_cast<const uint8_t*>(tensor.const_data_ptr()); }

WireReader reader_of(const Message& reply) {
  return WireReader(reply.payload.defined() ? reply.payload.data_ptr<uint8_t>() : nullptr,
                    static_cast<size_t>(reply.frame.payload_bytes));
}

std::vector<std::string> server_names(const std::vector<int>& server_ranks) {
  std::vector<std::string> names;
  for (size_t s = 0; s < server_ranks.size(); ++s) {
    names.push_back("parameter server " + std::to_string(s) + " (rank " + std::to_string(server_ranks[s]) + ")");
  }
  return names;
}

} // namespace

int row_owner(int64_t id, int num_servers) {
  // Mixed, not id % num_servers: skewed ids (all even, say) still spread over the servers.
  return static_cast<int>(splitmix64(static_cast<uint64_t>(id)) % static_cast<uint64_t>(num_servers));
}

Client::Client(c10::intrusive_ptr<c10d::ProcessGroup> group, int worker_index, std::vector<int> server_ranks,
               std::chrono::milliseconds timeout)
    : group_(std::move(group)),
      worker_index_(worker_index),
      server_ranks_(std::move(server_ranks)),
      timeout_(timeout),
      requests_(server_names(server_ranks_), timeout) {
  for (int s = 0; s < num_servers(); ++s) {
    channels_.push_back(std::make_unique<Channel>(
        group_, server_ranks_[s], kRequestTag, kReplyTag,
        [this, s](Message&& message) { return receive(s, std::move(message)); },
        [this, s](const std::string& reason) { requests_.server_failed(s, reason); }));
  }
  watchdog_ = std::thread([this] { watch_deadlines(); });
}

Client::~Client() {
  try {
    finish();
  } catch (const std::exception& error) {
    LOG(WARNING) << "torchpar.ps worker " << worker_index_ << ": finishing failed: " << message_of(error);
  }
  // Only here: a request refused after finish() may still be looking at its channel.
  channels_.clear();
}

void Client::send_request(int server, MessageKind kind, WireWriter payload, std::string what,
                          RequestTracker::OnReply on_reply, RequestTracker::OnError on_error,
                          RequestTracker::OnReply on_late_reply) {
  const int64_t id = next_request_++;
  std::lock_guard<std::recursive_mutex> order(send_order_);
  if (requests_.start(id, server, kind, std::move(what), std::move(on_reply), std::move(on_error),
                      RequestTracker::Clock::now(), std::move(on_late_reply))) {
    channels_[server]->send(make_message(kind, id, std::move(payload)));
  }
}

bool Client::receive(int server, Message&& message) {
  if (message.frame.kind == MessageKind::Bye) {
    requests_.server_said_goodbye(server);
    return false;
  }
  auto request = requests_.answer(message.frame.request_id);
  if (!request) {
    // Answered after its deadline: its future already failed, but the values it lends must go back.
    auto late_reply = requests_.late_reply(message.frame.request_id);
    if (late_reply && message.frame.kind == MessageKind::Ok) {
      try {
        late_reply(message);
      } catch (const std::exception& error) {
        LOG(WARNING) << "torchpar.ps worker " << worker_index_ << ": a late reply of "
                     << requests_.server_name(server) << " is malformed: " << message_of(error);
      }
    }
    return true;
  }
  if (message.frame.kind == MessageKind::Error) {
    std::string reason = "torchpar.ps: " + requests_.server_name(server) + " refused " + request->what;
    try {
      reason = reader_of(message).get_string("error");
    } catch (const std::exception&) {
    }
    request->on_error(reason);
    return true;
  }
  try {
    request->on_reply(message);
  } catch (const std::exception& error) {
    request->on_error("torchpar.ps: the reply of " + requests_.server_name(server) + " to " + request->what +
                      " is malformed: " + message_of(error));
  }
  return true;
}

void Client::hand_back_lendings(int server) {
  std::lock_guard<std::mutex> lock(tables_mutex_);
  for (const auto& table : tables_) {
    if (!table.sparse && table.mapped[server]) table.mapped[server]->hand_back_any();
  }
}

void Client::watch_deadlines() {
  const auto period = std::clamp(timeout_ / 10, std::chrono::milliseconds(10), std::chrono::milliseconds(500));
  std::unique_lock<std::mutex> lock(watch_mutex_);
  while (!stopping_) {
    stop_watch_.wait_for(lock, period, [&] { return stopping_; });
    lock.unlock();
    requests_.expire(RequestTracker::Clock::now());
    lock.lock();
  }
}

Future Client::send_parts(MessageKind kind, std::vector<ServerPart> parts, const std::string& what,
                          c10::TypePtr type, std::function<c10::IValue()> result) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(std::move(type));
  c10::List<Future> replies(c10::FutureType::create(c10::NoneType::get()));
  for (size_t i = 0; i < parts.size(); ++i) {
    auto reply = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
    // The first error fails the operation at once; the others are not waited for.
    reply->addCallback([future](c10::ivalue::Future& reply) {
      if (reply.hasError()) future->setErrorIfNeeded(reply.exception_ptr());
    });
    replies.push_back(reply);
  }
  // collectAll's callbacks run after each reply's own (added first): by then any error was forwarded.
  c10::collectAll(replies)->addCallback([future, result = std::move(result)](c10::ivalue::Future&) {
    if (future->completed()) return;
    try {
      future->markCompleted(result());
    } catch (const std::exception&) {
      future->setErrorIfNeeded(std::current_exception());
    }
  });
  for (size_t i = 0; i < parts.size(); ++i) {
    auto reply = replies.get(i);
    send_request(
        parts[i].server, kind, std::move(parts[i].payload), what,
        [reply, read = std::move(parts[i].read_reply)](const Message& message) {
          if (read) read(message);
          reply->markCompleted();
        },
        [reply](const std::string& reason) {
          reply->setErrorIfNeeded(std::make_exception_ptr(std::runtime_error(reason)));
        },
        std::move(parts[i].late_reply));
  }
  return future;
}

// A registration's reply: the table's id on server `s`, and its clock there (non-zero after a restore).
std::function<void(const Message&)> Client::record_registration(const std::shared_ptr<ClientTable>& table,
                                                                int s) const {
  return [table, s, worker = worker_index_](const Message& reply) {
    const auto registered = decode_registered(reply.payload.defined() ? reply.payload.data_ptr<uint8_t>() : nullptr,
                                              static_cast<size_t>(reply.frame.payload_bytes));
    table->server_table[s] = registered.table;
    table->clocks[s] = registered.clock;
    if (registered.values) {
      std::string why_not;
      table->mapped[s] = MappedValues::open(*registered.values, worker, &why_not);
      if (!table->mapped[s]) {
        LOG(INFO) << "torchpar.ps worker " << worker << ": the values of table '" << table->name
                  << "' come in the replies of server " << s << ": " << why_not;
      }
    }
  };
}

int Client::add_table(MessageKind kind, std::vector<ServerPart> parts, const std::shared_ptr<ClientTable>& table,
                      const std::string& what) {
  send_parts(kind, std::move(parts), what, c10::NoneType::get(), [] { return c10::IValue(); })->waitAndThrow();
  std::lock_guard<std::mutex> lock(tables_mutex_);
  tables_.push_back(*table);
  return static_cast<int>(tables_.size()) - 1;
}

int Client::dense_table(const std::string& name, const at::Tensor& initial, const OptimizerConfig& optimizer) {
  TORCH_CHECK(initial.defined() && initial.numel() > 0, "torchpar.ps: dense table '", name, "' needs initial values");
  auto table = std::make_shared<ClientTable>();
  table->name = name;
  table->dtype = initial.scalar_type();
  dtype_code(table->dtype);
  table->shape = initial.sizes().vec();
  table->numel = initial.numel();
  table->server_table.assign(num_servers(), -1);
  table->clocks.assign(num_servers(), 0);
  table->mapped.assign(num_servers(), nullptr);
  const auto flat = initial.detach().contiguous().view(-1).cpu();
  std::vector<ServerPart> parts;
  for (int s = 0; s < num_servers(); ++s) {
    table->shard_begin.push_back(table->numel * s / num_servers());
    table->shard_end.push_back(table->numel * (s + 1) / num_servers());
    if (table->shard_end[s] > table->shard_begin[s]) {
      DenseRegistration registration;
      registration.name = name;
      registration.dtype = table->dtype;
      registration.shape = table->shape;
      registration.shard_begin = table->shard_begin[s];
      registration.shard_end = table->shard_end[s];
      registration.optimizer = optimizer;
      registration.initial = bytes_of(flat) + table->shard_begin[s] * flat.element_size();
      WireWriter writer;
      encode_registration(writer, registration);
      parts.push_back({s, std::move(writer), record_registration(table, s)});
    }
  }
  return add_table(MessageKind::RegisterDense, std::move(parts), table, "registering table '" + name + "'");
}

int Client::sparse_table(const std::string& name, int64_t num_rows, int64_t dim, const OptimizerConfig& optimizer,
                         const RowInitializer& initializer, c10::ScalarType dtype) {
  auto table = std::make_shared<ClientTable>();
  table->name = name;
  table->sparse = true;
  table->dtype = dtype;
  table->num_rows = num_rows;
  table->dim = dim;
  table->server_table.assign(num_servers(), -1);
  table->clocks.assign(num_servers(), 0);
  SparseRegistration registration{name, dtype, num_rows, dim, initializer, optimizer};
  std::vector<ServerPart> parts;
  for (int s = 0; s < num_servers(); ++s) {
    WireWriter writer;
    encode_registration(writer, registration);
    parts.push_back({s, std::move(writer), record_registration(table, s)});
  }
  return add_table(MessageKind::RegisterSparse, std::move(parts), table, "registering sparse table '" + name + "'");
}

const ClientTable& Client::checked_table(int table, bool sparse, const char* operation) const {
  TORCH_CHECK(table >= 0 && table < static_cast<int>(tables_.size()), "torchpar.ps: ", operation,
              ": no table with handle ", table, " (", tables_.size(), " registered)");
  const auto& t = tables_[table];
  TORCH_CHECK(t.sparse == sparse, "torchpar.ps: ", operation, ": table '", t.name, "' is ",
              t.sparse ? "sparse (use pull_rows / push_rows)" : "dense (use pull / push)");
  return t;
}

ClientTable Client::table(int table) const {
  std::lock_guard<std::mutex> lock(tables_mutex_);
  TORCH_CHECK(table >= 0 && table < static_cast<int>(tables_.size()), "torchpar.ps: no table with handle ", table);
  return tables_[table];
}

int64_t Client::clock(int table) const {
  std::lock_guard<std::mutex> lock(tables_mutex_);
  TORCH_CHECK(table >= 0 && table < static_cast<int>(tables_.size()), "torchpar.ps: no table with handle ", table);
  const auto& t = tables_[table];
  int64_t clock = std::numeric_limits<int64_t>::max();
  for (int s = 0; s < num_servers(); ++s) {
    if (t.server_table[s] >= 0) clock = std::min(clock, t.clocks[s]);
  }
  return clock;
}

Future Client::pull(const std::vector<int>& tables) { return dense_operation(MessageKind::Pull, tables, {}); }

Future Client::push(const std::vector<int>& tables, const std::vector<at::Tensor>& grads) {
  return dense_operation(MessageKind::Push, tables, grads);
}

Future Client::push_pull(const std::vector<int>& tables, const std::vector<at::Tensor>& grads) {
  return dense_operation(MessageKind::PushPull, tables, grads);
}

Future Client::dense_operation(MessageKind kind, const std::vector<int>& tables, const std::vector<at::Tensor>& grads) {
  const bool pushing = kind != MessageKind::Pull;
  const bool reading = kind != MessageKind::Push;
  const char* operation = kind_name(kind);
  std::vector<at::Tensor> flat_grads;
  auto outputs = std::make_shared<std::vector<at::Tensor>>();
  std::string what = std::string(operation) + " of";
  // Clocks are assigned and messages queued in one go, so a server sees each table's pushes in clock order.
  std::lock_guard<std::recursive_mutex> order(send_order_);
  std::unique_lock<std::mutex> lock(tables_mutex_);
  TORCH_CHECK(!pushing || grads.size() == tables.size(), "torchpar.ps: ", operation, " of ", tables.size(),
              " tables with ", grads.size(), " gradients");
  for (size_t i = 0; i < tables.size(); ++i) {
    const auto& t = checked_table(tables[i], false, operation);
    what += (i ? ", '" : " '") + t.name + "'";
    if (pushing) {
      const auto& grad = grads[i];
      // The shape, not only the element count: a [3, 2] gradient for a [2, 3] table would be applied
      // to the wrong elements.
      TORCH_CHECK(grad.defined() && grad.sizes() == c10::IntArrayRef(t.shape), "torchpar.ps: ", operation,
                  " to table '", t.name, "' (shape ", c10::IntArrayRef(t.shape), "): a gradient of shape ",
                  grad.defined() ? c10::str(grad.sizes()) : std::string("undefined"),
                  "; gradients must have the table's shape");
      TORCH_CHECK(grad.scalar_type() == t.dtype, "torchpar.ps: ", operation, " to table '", t.name,
                  "': gradient dtype ", c10::toString(grad.scalar_type()), ", the table holds ",
                  c10::toString(t.dtype));
      flat_grads.push_back(grad.detach().contiguous().view(-1).cpu());
    }
    if (reading) outputs->push_back(at::empty(t.shape, at::TensorOptions().dtype(t.dtype)));
  }
  std::vector<ServerPart> parts;
  for (int s = 0; s < num_servers(); ++s) {
    std::vector<DenseItem> items;
    struct Read {
      size_t output;
      int64_t begin;  // the shard's, in the table
      int64_t numel;
      std::shared_ptr<MappedValues> mapped;
    };
    std::vector<Read> reads;
    for (size_t i = 0; i < tables.size(); ++i) {
      auto& t = tables_[tables[i]];
      if (t.server_table[s] < 0) continue;
      const int64_t begin = t.shard_begin[s];
      const int64_t n = t.shard_end[s] - begin;
      DenseItem item{static_cast<uint32_t>(t.server_table[s]), t.clocks[s], t.dtype, t.shape, n, nullptr};
      item.in_place = reading && t.mapped[s] != nullptr;
      if (pushing) {
        item.data = bytes_of(flat_grads[i]) + begin * flat_grads[i].element_size();
        t.clocks[s] += 1;
      }
      items.push_back(item);
      reads.push_back({i, begin, n, t.mapped[s]});
    }
    if (items.empty()) continue;
    WireWriter writer;
    encode_dense_items(writer, items, pushing);
    std::function<void(const Message&, bool late)> read_values;
    if (reading) {
      read_values = [outputs, reads](const Message& reply, bool late) {
        auto reader = reader_of(reply);
        struct Lent {
          MappedValues* mapped;
          uint64_t lending;
          uint8_t* destination;
          size_t bytes;
        };
        std::vector<Lent> lent;
        // Whatever goes wrong, every lending of this reply not yet read goes back at once (the server
        // waits for them before it changes those values).
        auto hand_back_from = [&](size_t first) {
          for (size_t k = first; k < lent.size(); ++k) lent[k].mapped->hand_back(lent[k].lending);
        };
        try {
          for (const auto& [index, begin, n, mapped] : reads) {
            auto& output = (*outputs)[index];
            const size_t bytes = n * output.element_size();
            auto* destination = static_cast<uint8_t*>(output.data_ptr()) + begin * output.element_size();
            if (reader.get<uint8_t>("values lent") != 0) {
              const auto lending = reader.get<uint64_t>("lending");
              TORCH_CHECK(mapped, "the server lends values of a table this worker has not mapped");
              lent.push_back({mapped.get(), lending, destination, bytes});
              continue;
            }
            const auto* data = reader.get_data(bytes, "values");
            if (late) {
              continue;
            } else if (n == output.numel()) {
              // One server holds the whole table: its reply is the tensor, no copy.
              auto payload = reply.payload;
              output = at::from_blob(
                  const_cast<uint8_t*>(data), output.sizes(), [payload](void*) {}, output.options());
            } else {
              std::memcpy(destination, data, bytes);
            }
          }
          reader.expect_end();
        } catch (...) {
          hand_back_from(0);
          throw;
        }
        if (late) {
          hand_back_from(0);
          return;
        }
        for (size_t k = 0; k < lent.size(); ++k) {
          try {
            lent[k].mapped->read(lent[k].lending, lent[k].bytes, lent[k].destination);
          } catch (...) {
            hand_back_from(k + 1);
            throw;
          }
        }
      };
    }
    if (reading) {
      parts.push_back({s, std::move(writer), [read_values](const Message& reply) { read_values(reply, false); },
                       [read_values](const Message& reply) { read_values(reply, true); }});
    } else {
      parts.push_back({s, std::move(writer), nullptr});
    }
  }
  lock.unlock();
  return send_parts(kind, std::move(parts), what,
                    reading ? c10::TypePtr(c10::ListType::ofTensors()) : c10::TypePtr(c10::NoneType::get()),
                    [outputs]() -> c10::IValue {
                      if (outputs->empty()) return c10::IValue();
                      return c10::IValue(c10::List<at::Tensor>(*outputs));
                    });
}

Future Client::pull_rows(const std::vector<int>& tables, const std::vector<at::Tensor>& ids) {
  return rows_operation(MessageKind::PullRows, tables, ids, {});
}

Future Client::push_rows(const std::vector<int>& tables, const std::vector<at::Tensor>& ids,
                         const std::vector<at::Tensor>& grads) {
  return rows_operation(MessageKind::PushRows, tables, ids, grads);
}

Future Client::rows_operation(MessageKind kind, const std::vector<int>& tables, const std::vector<at::Tensor>& ids,
                              const std::vector<at::Tensor>& grads) {
  const bool pushing = kind == MessageKind::PushRows;
  const char* operation = kind_name(kind);
  TORCH_CHECK(ids.size() == tables.size() && (!pushing || grads.size() == tables.size()), "torchpar.ps: ",
              operation, " of ", tables.size(), " tables with ", ids.size(), " id tensors",
              pushing ? " and " + std::to_string(grads.size()) + " gradients" : std::string());
  std::string what = std::string(operation) + " of";
  std::vector<DistinctIds> distinct;
  std::vector<at::Tensor> unique_rows;   // pull: [distinct, dim], filled by the replies
  std::vector<at::Tensor> summed_grads;  // push: [distinct, dim]
  std::vector<std::vector<int64_t>> shapes;
  std::lock_guard<std::recursive_mutex> order(send_order_);
  std::unique_lock<std::mutex> lock(tables_mutex_);
  for (size_t i = 0; i < tables.size(); ++i) {
    const auto& t = checked_table(tables[i], true, operation);
    what += (i ? ", '" : " '") + t.name + "'";
    TORCH_CHECK(ids[i].defined() && ids[i].scalar_type() == at::kLong, "torchpar.ps: ", operation, " of table '",
                t.name, "': ids must be int64, not ",
                ids[i].defined() ? c10::toString(ids[i].scalar_type()) : "undefined");
    const auto cpu_ids = ids[i].cpu().contiguous();
    distinct.push_back(distinct_ids(cpu_ids.const_data_ptr<int64_t>(), cpu_ids.numel()));
    for (int64_t id : distinct.back().ids) {
      TORCH_CHECK(id >= 0 && id < t.num_rows, "torchpar.ps: ", operation, " of table '", t.name, "': row id ", id,
                  " is out of range [0, ", t.num_rows, ")");
    }
    auto shape = ids[i].sizes().vec();
    shape.push_back(t.dim);
    shapes.push_back(shape);
    const int64_t count = static_cast<int64_t>(distinct.back().ids.size());
    if (pushing) {
      const auto& grad = grads[i];
      TORCH_CHECK(grad.defined() && grad.sizes().vec() == shape, "torchpar.ps: ", operation, " to table '", t.name,
                  "': gradients of shape ", grad.defined() ? c10::str(grad.sizes()) : std::string("undefined"),
                  " for ids of shape ", ids[i].sizes(), " (expected ", c10::IntArrayRef(shape), ")");
      TORCH_CHECK(grad.scalar_type() == t.dtype, "torchpar.ps: ", operation, " to table '", t.name,
                  "': gradient dtype ", c10::toString(grad.scalar_type()), ", the table holds ",
                  c10::toString(t.dtype));
      summed_grads.push_back(sum_rows(grad.detach().cpu().reshape({-1, t.dim}), distinct.back().inverse, count));
    } else {
      unique_rows.push_back(at::empty({count, t.dim}, at::TensorOptions().dtype(t.dtype)));
    }
  }
  std::vector<ServerPart> parts;
  for (int s = 0; s < num_servers(); ++s) {
    std::vector<RowsItem> items;
    std::vector<std::vector<int64_t>> item_ids;
    std::vector<at::Tensor> item_grads;
    std::vector<std::pair<size_t, std::vector<int64_t>>> reads; // table position, positions among distinct ids
    for (size_t i = 0; i < tables.size(); ++i) {
      auto& t = tables_[tables[i]];
      std::vector<int64_t> positions;
      std::vector<int64_t> owned;
      for (size_t p = 0; p < distinct[i].ids.size(); ++p) {
        if (row_owner(distinct[i].ids[p], num_servers()) == s) {
          positions.push_back(static_cast<int64_t>(p));
          owned.push_back(distinct[i].ids[p]);
        }
      }
      // A push reaches every server, empty or not: each counts this worker's clock.
      if (owned.empty() && !pushing) continue;
      RowsItem item{static_cast<uint32_t>(t.server_table[s]), t.clocks[s], t.dtype,
                    static_cast<int64_t>(owned.size()), t.dim, nullptr, nullptr};
      if (pushing) {
        item_grads.push_back(summed_grads[i]
                                 .index_select(0, at::from_blob(positions.data(), {item.count}, at::kLong))
                                 .contiguous());
        t.clocks[s] += 1;
      }
      item_ids.push_back(std::move(owned));
      items.push_back(item);
      reads.emplace_back(i, std::move(positions));
    }
    if (items.empty()) continue;
    for (size_t k = 0; k < items.size(); ++k) {
      items[k].ids = item_ids[k].data();
      if (pushing) items[k].data = bytes_of(item_grads[k]);
    }
    WireWriter writer;
    encode_rows_items(writer, items, pushing);
    std::function<void(const Message&)> read_rows;
    if (!pushing) {
      read_rows = [unique_rows, reads = std::move(reads)](const Message& reply) {
        auto reader = reader_of(reply);
        for (const auto& [index, positions] : reads) {
          const auto& rows = unique_rows[index];
          const int64_t count = static_cast<int64_t>(positions.size());
          const size_t bytes = count * rows.size(1) * rows.element_size();
          auto received = at::from_blob(const_cast<uint8_t*>(reader.get_data(bytes, "rows")), {count, rows.size(1)},
                                        rows.options());
          rows.index_copy_(0, at::from_blob(const_cast<int64_t*>(positions.data()), {count}, at::kLong), received);
        }
        reader.expect_end();
      };
    }
    parts.push_back({s, std::move(writer), std::move(read_rows)});
  }
  lock.unlock();
  return send_parts(kind, std::move(parts), what,
                    pushing ? c10::TypePtr(c10::NoneType::get()) : c10::TypePtr(c10::ListType::ofTensors()),
                    [unique_rows, distinct, shapes]() -> c10::IValue {
                      if (unique_rows.empty()) return c10::IValue();
                      c10::List<at::Tensor> rows;
                      for (size_t i = 0; i < unique_rows.size(); ++i) {
                        rows.push_back(unique_rows[i].index_select(0, distinct[i].inverse).view(shapes[i]));
                      }
                      return c10::IValue(rows);
                    });
}

void Client::set_learning_rate(int table, double lr) {
  std::vector<ServerPart> parts;
  std::string name;
  {
    std::lock_guard<std::mutex> lock(tables_mutex_);
    TORCH_CHECK(table >= 0 && table < static_cast<int>(tables_.size()), "torchpar.ps: no table with handle ", table);
    const auto& t = tables_[table];
    name = t.name;
    for (int s = 0; s < num_servers(); ++s) {
      if (t.server_table[s] < 0) continue;
      WireWriter writer;
      encode_learning_rate(writer, static_cast<uint32_t>(t.server_table[s]), lr);
      parts.push_back({s, std::move(writer), nullptr});
    }
  }
  send_parts(MessageKind::SetLearningRate, std::move(parts), "setting the learning rate of '" + name + "'",
             c10::NoneType::get(), [] { return c10::IValue(); })
      ->waitAndThrow();
}

void Client::checkpoint() {
  std::vector<ServerPart> parts;
  for (int s = 0; s < num_servers(); ++s) parts.push_back({s, {}, nullptr});
  send_parts(MessageKind::Checkpoint, std::move(parts), "checkpoint", c10::NoneType::get(),
             [] { return c10::IValue(); })
      ->waitAndThrow();
}

void Client::finish() {
  // Under send_order_: no request is between its checks and its sends while the finish goes out.
  std::unique_lock<std::recursive_mutex> order(send_order_);
  if (!requests_.finish()) return;
  // After a server died the job is broken: the others see this worker's connection close instead of a
  // clean finish, and keep their last consistent checkpoint rather than write one at the end.
  const bool server_lost = requests_.any_server_failed();
  for (int s = 0; s < num_servers() && !server_lost; ++s) {
    channels_[s]->send(make_message(MessageKind::Finish, next_request_++));
  }
  order.unlock(); // replies' callbacks may start requests (refused now) while we wait for the servers
  if (!server_lost) {
    requests_.wait_for_goodbyes(timeout_);
  }
  {
    std::lock_guard<std::mutex> lock(watch_mutex_);
    stopping_ = true;
  }
  stop_watch_.notify_all();
  watchdog_.join();
  requests_.fail_all("was not answered before this worker finished");
}

Future Client::send_raw(int server, int64_t kind, const at::Tensor& payload) {
  TORCH_CHECK(server >= 0 && server < num_servers(), "torchpar.ps: no server ", server);
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  const auto bytes = payload.contiguous().to(at::kByte);
  WireWriter data;
  data.append(bytes.const_data_ptr<uint8_t>(), static_cast<size_t>(bytes.numel()));
  send_request(
      server, static_cast<MessageKind>(kind), std::move(data), "a raw request",
      [this, server, future](const Message& reply) {
        hand_back_lendings(server);  // a raw read that asked for values in place
        future->markCompleted(reply.payload.defined() ? reply.payload.clone() : at::empty({0}, at::kByte));
      },
      [future](const std::string& reason) {
        future->setErrorIfNeeded(std::make_exception_ptr(std::runtime_error(reason)));
      },
      [this, server](const Message&) { hand_back_lendings(server); });
  return future;
}

} // namespace torchpar::ps
