#include <torchpar/ps/request_checks.h>

#include <torchpar/ps/dense_table.h>
#include <torchpar/ps/optimizer.h>
#include <torchpar/ps/sparse_table.h>

#include <c10/util/Exception.h>

#include <set>

namespace torchpar::ps {

Table& table_by_id(const Tables& tables, uint32_t id, int server_index) {
  TORCH_CHECK(id < tables.size(), "unknown table id ", id, " (server ", server_index, " holds ", tables.size(),
              " tables)");
  return *tables[id];
}

void check_items(const Request& request, const Tables& tables, int worker, const std::string& who, int server_index) {
  std::set<uint32_t> seen;
  const bool pushes = request.kind == MessageKind::Push || request.kind == MessageKind::PushPull ||
                      request.kind == MessageKind::PushRows;
  const char* verb = pushes ? "push to" : "pull from";
  for (const auto& item : request.dense) {
    const auto& t = table_by_id(tables, item.table, server_index);
    TORCH_CHECK(seen.insert(item.table).second, "table '", t.name(), "' listed twice in one request");
    TORCH_CHECK(!t.is_sparse(), verb, " table '", t.name(), "': it is sparse (use pull_rows / push_rows)");
    const auto& dense = static_cast<const DenseTable&>(t);
    TORCH_CHECK(item.dtype == t.dtype(), verb, " table '", t.name(), "': dtype ", c10::toString(item.dtype),
                ", the table holds ", c10::toString(t.dtype()));
    TORCH_CHECK(item.clock == t.pushes[worker], verb, " table '", t.name(), "' at clock ", item.clock, ": ", who,
                " has pushed ", t.pushes[worker], " times");
    TORCH_CHECK(item.shape == dense.shape(), verb, " table '", t.name(), "': ",
                pushes ? "a gradient of shape " : "a read of shape ", c10::IntArrayRef(item.shape),
                " for a table of shape ", c10::IntArrayRef(dense.shape()));
    TORCH_CHECK(item.numel == dense.numel(), verb, " table '", t.name(), "' (shape ", c10::IntArrayRef(dense.shape()),
                "; server ", server_index, " holds elements [", dense.shard_begin(), ", ", dense.shard_end(),
                ")): ", item.numel, " elements, expected ", dense.numel());
  }
  for (const auto& item : request.rows) {
    const auto& t = table_by_id(tables, item.table, server_index);
    TORCH_CHECK(seen.insert(item.table).second, "table '", t.name(), "' listed twice in one request");
    TORCH_CHECK(t.is_sparse(), verb, " table '", t.name(), "': it is dense (use pull / push)");
    const auto& sparse = static_cast<const SparseTable&>(t);
    TORCH_CHECK(item.dtype == t.dtype(), verb, " table '", t.name(), "': dtype ", c10::toString(item.dtype),
                ", the table holds ", c10::toString(t.dtype()));
    TORCH_CHECK(item.clock == t.pushes[worker], verb, " table '", t.name(), "' at clock ", item.clock, ": ", who,
                " has pushed ", t.pushes[worker], " times");
    TORCH_CHECK(item.dim == sparse.dim(), verb, " table '", t.name(), "': rows of ", item.dim,
                " values, the table's rows have ", sparse.dim());
    for (int64_t i = 0; i < item.count; ++i) {
      TORCH_CHECK(item.ids[i] >= 0 && item.ids[i] < sparse.num_rows(), verb, " table '", t.name(), "': row id ",
                  item.ids[i], " is out of range [0, ", sparse.num_rows(), ")");
    }
  }
}

void check_learning_rate(const Request& request, const Tables& tables, int server_index) {
  const auto& table = table_by_id(tables, request.table, server_index);
  TORCH_CHECK(request.lr >= 0, "learning rate ", request.lr, " is negative");
  auto updated = table.optimizer();
  updated.lr = request.lr;
  check_optimizer(updated, table.dtype(), table.name());
}

void check_registration(const Table& table, const DenseRegistration& registration) {
  TORCH_CHECK(!table.is_sparse(), "table '", registration.name, "' is already registered as a sparse table");
  const auto& dense = static_cast<const DenseTable&>(table);
  TORCH_CHECK(dense.shape() == registration.shape && dense.dtype() == registration.dtype &&
                  dense.shard_begin() == registration.shard_begin && dense.shard_end() == registration.shard_end,
              "table '", registration.name, "' registered as ", c10::toString(registration.dtype),
              c10::IntArrayRef(registration.shape), " (shard [", registration.shard_begin, ", ",
              registration.shard_end, ")), but it is ", c10::toString(dense.dtype()),
              c10::IntArrayRef(dense.shape()), " (shard [", dense.shard_begin(), ", ", dense.shard_end(), "))");
  TORCH_CHECK(table.optimizer().kind == registration.optimizer.kind, "table '", registration.name,
              "' registered with optimizer ", registration.optimizer.describe(), ", but it has ",
              table.optimizer().describe());
}

void check_registration(const Table& table, const SparseRegistration& registration) {
  TORCH_CHECK(table.is_sparse(), "table '", registration.name, "' is already registered as a dense table");
  const auto& sparse = static_cast<const SparseTable&>(table);
  TORCH_CHECK(sparse.num_rows() == registration.num_rows && sparse.dim() == registration.dim &&
                  sparse.dtype() == registration.dtype,
              "sparse table '", registration.name, "' registered with ", registration.num_rows, " rows of ",
              registration.dim, " ", c10::toString(registration.dtype), ", but it has ", sparse.num_rows(),
              " rows of ", sparse.dim(), " ", c10::toString(sparse.dtype()));
  TORCH_CHECK(table.optimizer().kind == registration.optimizer.kind, "sparse table '", registration.name,
              "' registered with optimizer ", registration.optimizer.describe(), ", but it has another");
}

} // namespace torchpar::ps
