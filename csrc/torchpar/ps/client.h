#pragma once
// A worker's side of the parameter service: registers tables, splits every operation over the
// servers holding its parts (one message per server, whatever the number of tables), and returns
// a c10::ivalue::Future completed by the replies. Requests a server leaves unanswered longer than
// the timeout, or a server's broken connection, fail their futures with a message naming it.
#include <torchpar/ps/channel.h>
#include <torchpar/ps/config.h>
#include <torchpar/ps/request_tracker.h>
#include <torchpar/ps/shared_values.h>

#include <ATen/core/ivalue.h>

#include <atomic>

namespace torchpar::ps {

using Future = c10::intrusive_ptr<c10::ivalue::Future>;

struct ClientTable {
  std::string name;
  bool sparse = false;
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> shape; // dense
  int64_t numel = 0;          // dense
  int64_t num_rows = 0;       // sparse
  int64_t dim = 0;            // sparse
  std::vector<int64_t> shard_begin; // dense, per server (empty shard: begin == end)
  std::vector<int64_t> shard_end;
  std::vector<int64_t> server_table; // the table's id on each server; -1: no part there
  std::vector<int64_t> clocks;       // this worker's pushes, as each server counts them
  // dense, per server: its shard's values mapped, read in place when the server lends them; else null
  std::vector<std::shared_ptr<MappedValues>> mapped;
};

class Client {
 public:
  Client(c10::intrusive_ptr<c10d::ProcessGroup> group, int worker_index, std::vector<int> server_ranks,
         std::chrono::milliseconds timeout);
  ~Client(); // finishes if finish() was not called

  // Every worker registers the same tables in any order; worker 0's `initial` values start a dense
  // table (the others' only fix its shape), unless the servers restored it from a checkpoint.
  int dense_table(const std::string& name, const at::Tensor& initial, const OptimizerConfig& optimizer);
  int sparse_table(const std::string& name, int64_t num_rows, int64_t dim, const OptimizerConfig& optimizer,
                   const RowInitializer& initializer = {}, c10::ScalarType dtype = c10::kFloat);

  // Futures of a list with one tensor per table (pulls) or of None (pushes).
  Future pull(const std::vector<int>& tables);
  Future push(const std::vector<int>& tables, const std::vector<at::Tensor>& grads);
  Future push_pull(const std::vector<int>& tables, const std::vector<at::Tensor>& grads);
  // ids: int64 of any shape; rows come back as [*ids.shape, dim]. Duplicate ids are read once and
  // their gradients summed before they are sent.
  Future pull_rows(const std::vector<int>& tables, const std::vector<at::Tensor>& ids);
  Future push_rows(const std::vector<int>& tables, const std::vector<at::Tensor>& ids,
                   const std::vector<at::Tensor>& grads);

  void set_learning_rate(int table, double lr);
  // Collective over the workers: returns once every server has written every table.
  void checkpoint();
  // Tells the servers this worker is done; later operations fail.
  void finish();

  // Pushes made to `table` (after a restore: counted from the checkpoint's clock).
  int64_t clock(int table) const;
  ClientTable table(int table) const;
  int num_servers() const { return static_cast<int>(server_ranks_.size()); }
  int worker_index() const { return worker_index_; }

  // Sends `payload` unchecked as a request of `kind` to server `server`: for testing the servers'
  // defences against malformed messages. The future holds the reply's payload bytes.
  Future send_raw(int server, int64_t kind, const at::Tensor& payload);

 private:
  // One server's share of an operation: its message (whose viewed data must last until send_parts
  // returns), and what to take from its reply (on the receiving thread; none when the reply carries nothing).
  struct ServerPart {
    int server;
    WireWriter payload;
    std::function<void(const Message&)> read_reply;
    // For a reply after the request's deadline (may be empty): what it lends goes back unread.
    std::function<void(const Message&)> late_reply = {};
  };

  void send_request(int server, MessageKind kind, WireWriter payload, std::string what,
                    RequestTracker::OnReply on_reply, RequestTracker::OnError on_error,
                    RequestTracker::OnReply on_late_reply = {});
  // Sends every part; the future completes with result() once all replied, or fails at the first error.
  Future send_parts(MessageKind kind, std::vector<ServerPart> parts, const std::string& what, c10::TypePtr type,
                    std::function<c10::IValue()> result);
  bool receive(int server, Message&& message);
  // Hands back every lending of server `server`'s values this worker holds, for a raw request's reply,
  // whose lendings are not known. A later reply already sent may hold one too: its read then fails
  // rather than return values that may have changed (raw requests are for testing malformed input).
  void hand_back_lendings(int server);
  void watch_deadlines();
  std::function<void(const Message&)> record_registration(const std::shared_ptr<ClientTable>& table, int s) const;
  int add_table(MessageKind kind, std::vector<ServerPart> parts, const std::shared_ptr<ClientTable>& table,
                const std::string& what);
  Future dense_operation(MessageKind kind, const std::vector<int>& tables, const std::vector<at::Tensor>& grads);
  Future rows_operation(MessageKind kind, const std::vector<int>& tables, const std::vector<at::Tensor>& ids,
                        const std::vector<at::Tensor>& grads);
  const ClientTable& checked_table(int table, bool sparse, const char* operation) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int worker_index_;
  std::vector<int> server_ranks_;
  std::chrono::milliseconds timeout_;

  std::recursive_mutex send_order_; // held from a request's checks to its sends (operations nest it)
  mutable std::mutex tables_mutex_;
  std::vector<ClientTable> tables_;
  RequestTracker requests_;
  std::atomic<int64_t> next_request_{1};
  std::vector<std::unique_ptr<Channel>> channels_; // after requests_: their threads call into it

  std::mutex watch_mutex_;
  bool stopping_ = false;
  std::condition_variable stop_watch_;
  std::thread watchdog_;
};

// The server holding row `id` of a sparse table.
int row_owner(int64_t id, int num_servers);

} // namespace torchpar::ps
