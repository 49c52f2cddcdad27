// Writes the wire fuzzer's seed corpus with the real encoders: valid messages of every kind for the
// tables of ps_wire_fuzz.h, and short streams (register a table, push to it, read it, push again)
// that take the fuzzer past the checks into the tables. With --check it compares instead, so ctest
// fails once the wire format changes under a corpus that no longer holds valid messages.
//   ps_wire_corpus DIR           (re)writes DIR/seed-*
//   ps_wire_corpus --check DIR   fails when DIR's seeds differ from what this writes
#include "ps_wire_fuzz.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

namespace torchpar::ps::fuzz {
namespace {

using Bytes = std::vector<uint8_t>;

struct Stream {
  Bytes bytes;
  int64_t next_id = 1;

  Stream& add(MessageKind kind, const Bytes& payload = {}) {
    int64_t fields[Frame::kFields];
    encode_frame(Frame{kind, next_id++, static_cast<int64_t>(payload.size())}, fields);
    const auto* frame = reinterpret_cast<const uint8_t*>(fields);
    bytes.insert(bytes.end(), frame, frame + sizeof(fields));
    bytes.insert(bytes.end(), payload.begin(), payload.end());
    return *this;
  }
  template <typename Encode>
  Stream& add(MessageKind kind, Encode encode) {
    WireWriter writer;
    encode(writer);
    return add(kind, writer.release());
  }
};

// Gradients and initial values: numel values of the dtype (the checks look at their count only).
const uint8_t* values(c10::ScalarType dtype, int64_t numel) {
  constexpr int64_t kMost = 64;
  static const std::vector<float> floats(kMost, 0.25f);
  static const std::vector<double> doubles(kMost, 0.25);
  TORCH_CHECK(numel <= kMost, "ps_wire_corpus: a seed of ", numel, " values; at most ", kMost);
  return dtype == c10::kDouble ? reinterpret_cast<const uint8_t*>(doubles.data())
                               : reinterpret_cast<const uint8_t*>(floats.data());
}

DenseItem dense_item(const DenseRegistration& table, uint32_t id, int64_t clock, bool with_data) {
  const int64_t numel = table.shard_end - table.shard_begin;
  return DenseItem{id, clock, table.dtype, table.shape, numel, with_data ? values(table.dtype, numel) : nullptr};
}

RowsItem rows_item(const SparseRegistration& table, uint32_t id, int64_t clock, const std::vector<int64_t>& ids,
                   bool with_data) {
  const auto count = static_cast<int64_t>(ids.size());
  return RowsItem{id, clock, table.dtype, count, table.dim, ids.data(),
                  with_data ? values(table.dtype, count * table.dim) : nullptr};
}

std::map<std::string, Bytes> seeds() {
  const auto tables = initial_tables();
  const auto& weight = std::get<DenseRegistration>(tables[0]);
  const auto& bias = std::get<DenseRegistration>(tables[1]);
  const auto& embedding = std::get<SparseRegistration>(tables[2]);
  const auto& items = std::get<SparseRegistration>(tables[3]);
  const uint32_t next_table = static_cast<uint32_t>(tables.size());
  const std::vector<int64_t> embedding_ids{0, 17, 999};
  const std::vector<int64_t> item_ids{49};

  std::map<std::string, Stream> streams;
  streams["seed-register-dense"].add(MessageKind::RegisterDense, [&](auto& w) { encode_registration(w, weight); });
  streams["seed-register-sparse"].add(MessageKind::RegisterSparse, [&](auto& w) { encode_registration(w, embedding); });
  streams["seed-pull"].add(MessageKind::Pull, [&](auto& w) {
    auto in_place = dense_item(weight, 0, 0, false);
    in_place.in_place = true;
    encode_dense_items(w, {in_place, dense_item(bias, 1, 0, false)}, false);
  });
  streams["seed-push"].add(MessageKind::Push, [&](auto& w) {
    encode_dense_items(w, {dense_item(weight, 0, 0, true), dense_item(bias, 1, 0, true)}, true);
  });
  streams["seed-push-pull"].add(MessageKind::PushPull,
                                [&](auto& w) { encode_dense_items(w, {dense_item(bias, 1, 0, true)}, true); });
  streams["seed-pull-rows"].add(MessageKind::PullRows, [&](auto& w) {
    encode_rows_items(w, {rows_item(embedding, 2, 0, embedding_ids, false), rows_item(items, 3, 0, item_ids, false)},
                      false);
  });
  streams["seed-push-rows"].add(MessageKind::PushRows, [&](auto& w) {
    encode_rows_items(w, {rows_item(embedding, 2, 0, embedding_ids, true), rows_item(items, 3, 0, item_ids, true)},
                      true);
  });
  streams["seed-set-learning-rate"].add(MessageKind::SetLearningRate,
                                        [&](auto& w) { encode_learning_rate(w, 1, 0.5); });
  streams["seed-checkpoint"].add(MessageKind::Checkpoint);
  streams["seed-finish"].add(MessageKind::Finish);
  streams["seed-reply-registered"].add(MessageKind::Ok, [&](auto& w) {
    encode_registered(w, {3, 12, true, RegionOffer{"host", 4242, 17, 0x5eed, 4096, 1 << 20}});
  });
  streams["seed-reply-error"].add(MessageKind::Error, [&](auto& w) { w.put_string("torchpar.ps: refused"); });

  // Streams: the second push is at clock 1; new tables take the next id.
  streams["seed-stream-push-twice"]
      .add(MessageKind::Push, [&](auto& w) { encode_dense_items(w, {dense_item(weight, 0, 0, true)}, true); })
      .add(MessageKind::Push, [&](auto& w) { encode_dense_items(w, {dense_item(weight, 0, 1, true)}, true); })
      .add(MessageKind::PushRows,
           [&](auto& w) { encode_rows_items(w, {rows_item(embedding, 2, 0, embedding_ids, true)}, true); })
      .add(MessageKind::PullRows,
           [&](auto& w) { encode_rows_items(w, {rows_item(embedding, 2, 1, embedding_ids, false)}, false); });
  const DenseRegistration fresh{"fresh", c10::kFloat, {2, 3}, 2, 6, OptimizerConfig::adagrad(0.1), values(c10::kFloat, 4)};
  streams["seed-stream-new-dense"]
      .add(MessageKind::RegisterDense, [&](auto& w) { encode_registration(w, fresh); })
      .add(MessageKind::PushPull,
           [&](auto& w) { encode_dense_items(w, {dense_item(fresh, next_table, 0, true)}, true); })
      .add(MessageKind::SetLearningRate, [&](auto& w) { encode_learning_rate(w, next_table, 0.01); })
      .add(MessageKind::Pull, [&](auto& w) { encode_dense_items(w, {dense_item(fresh, next_table, 1, false)}, false); });
  const SparseRegistration wide{"wide", c10::kFloat, 100000, 8, RowInitializer::normal(0, 0.01, 3),
                                OptimizerConfig::adam(0.001)};
  const std::vector<int64_t> wide_ids{99999, 5, 12345};
  streams["seed-stream-new-sparse"]
      .add(MessageKind::RegisterSparse, [&](auto& w) { encode_registration(w, wide); })
      .add(MessageKind::PushRows, [&](auto& w) { encode_rows_items(w, {rows_item(wide, next_table, 0, wide_ids, true)}, true); })
      .add(MessageKind::PullRows,
           [&](auto& w) { encode_rows_items(w, {rows_item(wide, next_table, 1, wide_ids, false)}, false); })
      .add(MessageKind::Finish);

  std::map<std::string, Bytes> files;
  for (auto& [name, stream] : streams) files[name] = std::move(stream.bytes);
  return files;
}

Bytes read_file(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  return Bytes{std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

} // namespace
} // namespace torchpar::ps::fuzz

int main(int argc, char** argv) {
  const bool check = argc == 3 && std::string(argv[1]) == "--check";
  if (argc != 2 && !check) {
    std::fprintf(stderr, "usage: %s [--check] DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path dir(argv[argc - 1]);
  const auto seeds = torchpar::ps::fuzz::seeds();
  if (!check) {
    std::filesystem::create_directories(dir);
    for (const auto& [name, bytes] : seeds) {
      std::ofstream(dir / name, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    }
    std::printf("wrote %zu seeds to %s\n", seeds.size(), dir.c_str());
    return 0;
  }
  int stale = 0;
  for (const auto& [name, bytes] : seeds) {
    if (!std::filesystem::exists(dir / name) || torchpar::ps::fuzz::read_file(dir / name) != bytes) {
      std::fprintf(stderr, "%s: missing or not what the encoders write now\n", (dir / name).c_str());
      ++stale;
    }
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    if (name.rfind("seed-", 0) == 0 && !seeds.count(name)) {
      std::fprintf(stderr, "%s: no longer written by %s\n", entry.path().c_str(), argv[0]);
      ++stale;
    }
  }
  if (stale > 0) {
    std::fprintf(stderr, "the seed corpus is stale: rewrite it with `%s %s`\n", argv[0], dir.c_str());
    return 1;
  }
  std::printf("%zu seeds in %s are current\n", seeds.size(), dir.c_str());
  return 0;
}
