#pragma once
// What a server checks of a decoded request against the tables it holds, before it changes or reads
// anything. No communication and no server state beyond the tables, so the wire-format fuzzer
// (tests/fuzz) runs every request kind through exactly the server's checks.
#include <torchpar/ps/messages.h>
#include <torchpar/ps/table.h>

#include <string>

namespace torchpar::ps {

// The table `id` names on server `server_index`; throws when it holds no such table.
Table& table_by_id(const Tables& tables, uint32_t id, int server_index);

// A pull, push, push_pull, pull_rows or push_rows of `worker` (named `who` in messages): every
// table exists and is listed once, is of the item's kind, dtype and shape (rows: width), the item's
// clock is the worker's pushes to it, and every row id is in range. After it, every item's data and
// ids can be read for the table's sizes.
void check_items(const Request& request, const Tables& tables, int worker, const std::string& who, int server_index);

// A set-learning-rate request: a table of this server, a learning rate that is not negative and that
// the table's optimizer can step with (check_optimizer).
void check_learning_rate(const Request& request, const Tables& tables, int server_index);

// A registration of a table the server already holds (created by it, restored, or registered
// before) must describe that table exactly.
void check_registration(const Table& table, const DenseRegistration& registration);
void check_registration(const Table& table, const SparseRegistration& registration);

} // namespace torchpar::ps
