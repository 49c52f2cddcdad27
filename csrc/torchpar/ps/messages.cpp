#include <torchpar/ps/messages.h>

#include <torchpar/ps/optimizer.h>

#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <cmath>

namespace torchpar::ps {
namespace {

constexpr int64_t kMaxElements = int64_t{1} << 40;
constexpr uint32_t kMaxItems = 1 << 20;
constexpr uint32_t kMaxDims = 16;

int64_t checked_count(int64_t count, const char* what) {
  TORCH_CHECK(count >= 0 && count <= kMaxElements, "torchpar.ps: malformed message: ", what, " is ", count);
  return count;
}

OptimizerConfig read_optimizer(WireReader& reader) {
  OptimizerConfig config;
  const auto kind = reader.get<uint8_t>("optimizer kind");
  TORCH_CHECK(kind >= 1 && kind <= 3, "torchpar.ps: unknown optimizer code ", int(kind));
  config.kind = static_cast<OptimizerConfig::Kind>(kind);
  config.lr = reader.get<double>("lr");
  config.momentum = reader.get<double>("momentum");
  config.weight_decay = reader.get<double>("weight_decay");
  config.beta1 = reader.get<double>("beta1");
  config.beta2 = reader.get<double>("beta2");
  config.eps = reader.get<double>("eps");
  config.initial_accumulator = reader.get<double>("initial_accumulator");
  return config;
}

void write_optimizer(WireWriter& writer, const OptimizerConfig& config) {
  writer.put<uint8_t>(static_cast<uint8_t>(config.kind));
  for (double value : {config.lr, config.momentum, config.weight_decay, config.beta1, config.beta2, config.eps,
                       config.initial_accumulator}) {
    writer.put<double>(value);
  }
}

// The preconditions of std::uniform_real_distribution and std::normal_distribution, which draw the
// rows' first values: outside them the draw is undefined.
void check_initializer(const RowInitializer& initializer, const std::string& table) {
  const double a = initializer.a;
  const double b = initializer.b;
  const bool uniform = initializer.kind == RowInitializer::Kind::Uniform;
  const bool normal = initializer.kind == RowInitializer::Kind::Normal;
  TORCH_CHECK(!uniform || (std::isfinite(a) && std::isfinite(b) && a <= b && std::isfinite(b - a)),
              "torchpar.ps: sparse table '", table, "': uniform initializer over [", a, ", ", b,
              "): the bounds must be finite, low <= high");
  TORCH_CHECK(!normal || (std::isfinite(a) && std::isfinite(b) && b > 0), "torchpar.ps: sparse table '", table,
              "': normal initializer of mean ", a, " and std ", b, ": both must be finite, std > 0");
}

// Dense and rows items share their count and each item's head (table, clock, dtype).
template <typename Item, typename ReadRest>
std::vector<Item> read_items(WireReader& reader, ReadRest read_rest) {
  const auto count = reader.get<uint32_t>("item count");
  TORCH_CHECK(count <= kMaxItems, "torchpar.ps: malformed message: ", count, " items");
  std::vector<Item> items(count);
  for (auto& item : items) {
    item.table = reader.get<uint32_t>("table id");
    item.clock = reader.get<int64_t>("clock");
    item.dtype = dtype_from_code(reader.get<uint8_t>("dtype"));
    read_rest(item);
  }
  return items;
}

template <typename Item, typename WriteRest>
void write_items(WireWriter& writer, const std::vector<Item>& items, WriteRest write_rest) {
  writer.put<uint32_t>(static_cast<uint32_t>(items.size()));
  for (const auto& item : items) {
    writer.put<uint32_t>(item.table);
    writer.put<int64_t>(item.clock);
    writer.put<uint8_t>(dtype_code(item.dtype));
    write_rest(item);
  }
}

std::vector<int64_t> read_shape(WireReader& reader) {
  const auto dims = reader.get<uint32_t>("dimensions");
  TORCH_CHECK(dims <= kMaxDims, "torchpar.ps: malformed message: a table of ", dims, " dimensions");
  std::vector<int64_t> shape;
  int64_t numel = 1;
  for (uint32_t d = 0; d < dims; ++d) {
    shape.push_back(checked_count(reader.get<int64_t>("size"), "a table size"));
    const int64_t size = shape.back();
    TORCH_CHECK(size == 0 || numel <= kMaxElements / size, "torchpar.ps: malformed message: a table of more than ",
                kMaxElements, " elements");
    numel *= size;
  }
  return shape;
}

void write_shape(WireWriter& writer, const std::vector<int64_t>& shape) {
  writer.put<uint32_t>(static_cast<uint32_t>(shape.size()));
  for (int64_t size : shape) {
    writer.put<int64_t>(size);
  }
}

std::vector<DenseItem> read_dense_items(WireReader& reader, bool with_data) {
  return read_items<DenseItem>(reader, [&](DenseItem& item) {
    item.shape = read_shape(reader);
    item.numel = checked_count(reader.get<int64_t>("numel"), "an element count");
    item.in_place = reader.get<uint8_t>("in-place flag") != 0;
    if (with_data) {
      item.data = reader.get_data(item.numel * c10::elementSize(item.dtype), "gradient data");
    }
  });
}

std::vector<RowsItem> read_rows_items(WireReader& reader, bool with_data) {
  return read_items<RowsItem>(reader, [&](RowsItem& item) {
    item.count = checked_count(reader.get<int64_t>("row count"), "a row count");
    item.dim = checked_count(reader.get<int64_t>("row width"), "a row width");
    item.ids = reinterpret_cast<const int64_t*>(reader.get_data(item.count * sizeof(int64_t), "row ids"));
    if (with_data) {
      TORCH_CHECK(item.dim == 0 || item.count <= kMaxElements / item.dim, "torchpar.ps: malformed message: ",
                  item.count, " rows of ", item.dim);
      item.data = reader.get_data(item.count * item.dim * c10::elementSize(item.dtype), "row gradients");
    }
  });
}

} // namespace

Request decode_request(MessageKind kind, const uint8_t* payload, size_t size) {
  WireReader reader(payload, size);
  Request request;
  request.kind = kind;
  switch (kind) {
    case MessageKind::Pull:
      request.dense = read_dense_items(reader, false);
      break;
    case MessageKind::Push:
    case MessageKind::PushPull:
      request.dense = read_dense_items(reader, true);
      break;
    case MessageKind::PullRows:
      request.rows = read_rows_items(reader, false);
      break;
    case MessageKind::PushRows:
      request.rows = read_rows_items(reader, true);
      break;
    case MessageKind::RegisterDense: {
      DenseRegistration registration;
      registration.name = reader.get_string("table name");
      registration.dtype = dtype_from_code(reader.get<uint8_t>("dtype"));
      registration.shape = read_shape(reader);
      const int64_t numel = c10::multiply_integers(registration.shape);
      registration.shard_begin = reader.get<int64_t>("shard begin");
      registration.shard_end = reader.get<int64_t>("shard end");
      TORCH_CHECK(0 <= registration.shard_begin && registration.shard_begin < registration.shard_end &&
                      registration.shard_end <= numel,
                  "torchpar.ps: table '", registration.name, "': shard [", registration.shard_begin, ", ",
                  registration.shard_end, ") is not inside its ", numel, " elements");
      registration.optimizer = read_optimizer(reader);
      check_optimizer(registration.optimizer, registration.dtype, registration.name);
      registration.initial = reader.get_data(
          (registration.shard_end - registration.shard_begin) * c10::elementSize(registration.dtype), "initial values");
      request.dense_registration = std::move(registration);
      break;
    }
    case MessageKind::RegisterSparse: {
      SparseRegistration registration;
      registration.name = reader.get_string("table name");
      registration.dtype = dtype_from_code(reader.get<uint8_t>("dtype"));
      registration.num_rows = reader.get<int64_t>("row count");
      registration.dim = reader.get<int64_t>("row width");
      TORCH_CHECK(registration.num_rows > 0 && registration.dim > 0 && registration.dim <= (1 << 20),
                  "torchpar.ps: sparse table '", registration.name, "' of ", registration.num_rows, " rows of ",
                  registration.dim);
      const auto initializer = reader.get<uint8_t>("initializer kind");
      TORCH_CHECK(initializer >= 1 && initializer <= 3, "torchpar.ps: unknown initializer code ", int(initializer));
      registration.initializer.kind = static_cast<RowInitializer::Kind>(initializer);
      registration.initializer.a = reader.get<double>("initializer a");
      registration.initializer.b = reader.get<double>("initializer b");
      registration.initializer.seed = reader.get<uint64_t>("initializer seed");
      check_initializer(registration.initializer, registration.name);
      registration.optimizer = read_optimizer(reader);
      check_optimizer(registration.optimizer, registration.dtype, registration.name);
      request.sparse_registration = std::move(registration);
      break;
    }
    case MessageKind::SetLearningRate:
      request.table = reader.get<uint32_t>("table id");
      request.lr = reader.get<double>("lr");
      break;
    case MessageKind::Checkpoint:
    case MessageKind::Finish:
      break;
    default:
      TORCH_CHECK(false, "torchpar.ps: unknown request kind ", static_cast<int64_t>(kind));
  }
  reader.expect_end();
  return request;
}

void encode_dense_items(WireWriter& writer, const std::vector<DenseItem>& items, bool with_data) {
  size_t bytes = 4;
  for (const auto& item : items) {
    bytes += 45 + 8 * item.shape.size();
  }
  writer.reserve(writer.size() + bytes);
  write_items(writer, items, [&](const DenseItem& item) {
    write_shape(writer, item.shape);
    writer.put<int64_t>(item.numel);
    writer.put<uint8_t>(item.in_place ? 1 : 0);
    if (with_data) {
      writer.put_data_view(item.data, item.numel * c10::elementSize(item.dtype));
    }
  });
}

void encode_rows_items(WireWriter& writer, const std::vector<RowsItem>& items, bool with_data) {
  size_t bytes = 4;
  for (const auto& item : items) {
    bytes += 56 + item.count * (8 + (with_data ? item.dim * c10::elementSize(item.dtype) : 0));
  }
  writer.reserve(writer.size() + bytes);
  write_items(writer, items, [&](const RowsItem& item) {
    writer.put<int64_t>(item.count);
    writer.put<int64_t>(item.dim);
    writer.put_data(item.ids, item.count * sizeof(int64_t));
    if (with_data) {
      writer.put_data(item.data, item.count * item.dim * c10::elementSize(item.dtype));
    }
  });
}

void encode_registration(WireWriter& writer, const DenseRegistration& registration) {
  writer.put_string(registration.name);
  writer.put<uint8_t>(dtype_code(registration.dtype));
  write_shape(writer, registration.shape);
  writer.put<int64_t>(registration.shard_begin);
  writer.put<int64_t>(registration.shard_end);
  write_optimizer(writer, registration.optimizer);
  writer.put_data(registration.initial,
                  (registration.shard_end - registration.shard_begin) * c10::elementSize(registration.dtype));
}

void encode_registration(WireWriter& writer, const SparseRegistration& registration) {
  writer.put_string(registration.name);
  writer.put<uint8_t>(dtype_code(registration.dtype));
  writer.put<int64_t>(registration.num_rows);
  writer.put<int64_t>(registration.dim);
  writer.put<uint8_t>(static_cast<uint8_t>(registration.initializer.kind));
  writer.put<double>(registration.initializer.a);
  writer.put<double>(registration.initializer.b);
  writer.put<uint64_t>(registration.initializer.seed);
  write_optimizer(writer, registration.optimizer);
}

void encode_learning_rate(WireWriter& writer, uint32_t table, double lr) {
  writer.put<uint32_t>(table);
  writer.put<double>(lr);
}

void encode_registered(WireWriter& writer, const Registered& registered) {
  writer.put<uint32_t>(registered.table);
  writer.put<int64_t>(registered.clock);
  writer.put<uint8_t>(registered.restored ? 1 : 0);
  writer.put<uint8_t>(registered.values ? 1 : 0);
  if (registered.values) put_offer(writer, *registered.values);
}

Registered decode_registered(const uint8_t* payload, size_t size) {
  WireReader reader(payload, size);
  Registered registered;
  registered.table = reader.get<uint32_t>("table id");
  registered.clock = reader.get<int64_t>("clock");
  registered.restored = reader.get<uint8_t>("restored") != 0;
  if (reader.get<uint8_t>("values offered") != 0) registered.values = get_offer(reader);
  reader.expect_end();
  return registered;
}

} // namespace torchpar::ps
