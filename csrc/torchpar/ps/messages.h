#pragma once
// The bodies of parameter-server requests and replies, on top of wire_format's fields. Decoding
// checks every count, size and dtype code against the bytes present; the server then checks the
// decoded items against its tables before it changes anything.
#include <torchpar/ps/config.h>
#include <torchpar/ps/region_offer.h>
#include <torchpar/ps/wire_format.h>

#include <optional>

namespace torchpar::ps {

// A dense shard's values or gradient; `data` points into the message (null in a pull).
struct DenseItem {
  uint32_t table = 0;
  int64_t clock = 0; // the worker's pushes to this table before this one
  c10::ScalarType dtype = c10::kFloat;
  // The whole table's shape as the worker sees it (a push: its gradient's), which the server checks
  // against the table's: an element count alone would let a transposed gradient land on wrong elements.
  std::vector<int64_t> shape;
  int64_t numel = 0; // of this shard
  const uint8_t* data = nullptr;
  // A read: the worker has mapped the shard's values (shared_values.h), so they may be lent.
  bool in_place = false;
};

// Rows of a sparse table: distinct ids (the client sums duplicates) and, in a push, their gradients.
struct RowsItem {
  uint32_t table = 0;
  int64_t clock = 0;
  c10::ScalarType dtype = c10::kFloat;
  int64_t count = 0;
  int64_t dim = 0;
  const int64_t* ids = nullptr;
  const uint8_t* data = nullptr;
};

struct DenseRegistration {
  std::string name;
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> shape;
  int64_t shard_begin = 0; // this server's range of the flattened table
  int64_t shard_end = 0;
  OptimizerConfig optimizer;
  const uint8_t* initial = nullptr; // the shard's initial values
};

struct SparseRegistration {
  std::string name;
  c10::ScalarType dtype = c10::kFloat;
  int64_t num_rows = 0;
  int64_t dim = 0;
  RowInitializer initializer;
  OptimizerConfig optimizer;
};

struct Request {
  MessageKind kind = MessageKind::Pull;
  std::vector<DenseItem> dense;   // Pull, Push, PushPull
  std::vector<RowsItem> rows;     // PullRows, PushRows
  std::optional<DenseRegistration> dense_registration;
  std::optional<SparseRegistration> sparse_registration;
  uint32_t table = 0; // SetLearningRate
  double lr = 0.0;
};

// Throws with the reason on anything malformed; pointers in the result point into `payload`.
Request decode_request(MessageKind kind, const uint8_t* payload, size_t size);

// The items' data are viewed, not copied (WireWriter::put_data_view).
void encode_dense_items(WireWriter& writer, const std::vector<DenseItem>& items, bool with_data);
void encode_rows_items(WireWriter& writer, const std::vector<RowsItem>& items, bool with_data);
void encode_registration(WireWriter& writer, const DenseRegistration& registration);
void encode_registration(WireWriter& writer, const SparseRegistration& registration);
void encode_learning_rate(WireWriter& writer, uint32_t table, double lr);

// The reply to a registration.
struct Registered {
  uint32_t table = 0;
  int64_t clock = 0;    // the worker's pushes so far (non-zero after a restore)
  bool restored = false;
  std::optional<RegionOffer> values; // a dense shard whose values workers on the server's host may map
};
void encode_registered(WireWriter& writer, const Registered& registered);
Registered decode_registered(const uint8_t* payload, size_t size);

} // namespace torchpar::ps
