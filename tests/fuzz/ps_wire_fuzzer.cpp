// libFuzzer target: the parameter server's wire format and its checks. Each input is a stream of
// messages (ps_wire_fuzz.h); each message goes through everything a server runs before it changes
// or reads a table — decode_frame, decode_request of its kind, the checks of request_checks.h — and
// a request those accept is then applied and read as the server does, so an accepted item whose
// sizes do not match its bytes is found (by ASan in the fuzzing and sanitizer builds, by the
// explicit bounds checks below in every build). A refusal (c10::Error) is the expected outcome of a
// malformed message; anything else escaping, a crash or a sanitizer report is a finding.
#include "ps_wire_fuzz.h"

#include <torchpar/ps/dense_table.h>
#include <torchpar/ps/request_checks.h>
#include <torchpar/ps/sparse_table.h>

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <variant>

namespace torchpar::ps::fuzz {
namespace {

constexpr size_t kFrameBytes = Frame::kFields * 8;
constexpr int kMaxMessages = 16;
// A read's reply holds count x width values: as large as the worker asked for, however large, so the
// fuzzer's malloc limit must not count it. Larger reads are checked, not read; an allocation past
// the limit is then one the message did not ask for.
constexpr int64_t kLargestRead = int64_t{64} << 20;

// PS_WIRE_FUZZ_VERBOSE=1: each message's outcome on stderr (what a seed or a reproducer reaches).
const bool verbose = std::getenv("PS_WIRE_FUZZ_VERBOSE") != nullptr;

void say(const char* kind, const char* outcome) {
  if (verbose) std::fprintf(stderr, "  %s: %s\n", kind, outcome);
}

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "ps_wire_fuzzer: %s\n", what);
  std::abort();
}

// What an accepted request may point at: its own payload, nothing around it.
void require_inside(const uint8_t* begin, size_t bytes, const uint8_t* payload, size_t size, const char* what) {
  if (bytes > 0 && (begin < payload || begin > payload + size || bytes > static_cast<size_t>(payload + size - begin))) {
    broken(what);
  }
}

// Server 0's tables, as it creates them from registrations.
struct Server {
  Tables tables;
  std::map<std::string, uint32_t> ids;

  void add(const DenseRegistration& registration) {
    const int64_t numel = registration.shard_end - registration.shard_begin;
    auto initial = at::from_blob(const_cast<uint8_t*>(registration.initial), {numel}, registration.dtype).clone();
    add(std::make_unique<DenseTable>(registration.name, registration.shape, registration.shard_begin,
                                     registration.shard_end, std::move(initial), registration.optimizer, kWorkers));
  }
  void add(const SparseRegistration& registration) {
    add(std::make_unique<SparseTable>(registration.name, registration.dtype, registration.num_rows, registration.dim,
                                      registration.initializer, registration.optimizer, kWorkers));
  }
  void add(std::unique_ptr<Table> table) {
    ids[table->name()] = static_cast<uint32_t>(tables.size());
    tables.push_back(std::move(table));
  }

  // As Server::register_dense / register_sparse: a new name creates the table, then the registration
  // must match the table of that name — always so for the table it just created.
  template <typename Registration>
  void register_table(const Registration& registration) {
    const bool created = !ids.count(registration.name);
    if (created) {
      add(registration);
    }
    try {
      check_registration(*tables[ids.at(registration.name)], registration);
    } catch (const c10::Error&) {
      if (created) broken("a table refused the registration it was created from");
      throw;
    }
  }

  void handle(MessageKind kind, const uint8_t* payload, size_t size) {
    switch (kind) {
      case MessageKind::Ok: // the reply to a registration, as the client decodes it
        decode_registered(payload, size);
        return;
      case MessageKind::Error: {
        WireReader reader(payload, size);
        reader.get_string("error");
        return;
      }
      case MessageKind::Bye:
        return;
      default:
        break;
    }
    const Request request = decode_request(kind, payload, size);
    switch (kind) {
      case MessageKind::RegisterDense: {
        const auto& registration = *request.dense_registration;
        const int64_t numel = registration.shard_end - registration.shard_begin;
        require_inside(registration.initial, numel * c10::elementSize(registration.dtype), payload, size,
                       "a registration's initial values lie outside its payload");
        register_table(registration);
        return;
      }
      case MessageKind::RegisterSparse:
        register_table(*request.sparse_registration);
        return;
      case MessageKind::SetLearningRate:
        check_learning_rate(request, tables, kServer);
        tables[request.table]->optimizer().lr = request.lr;
        return;
      case MessageKind::Checkpoint:
      case MessageKind::Finish:
        return;
      default:
        break;
    }
    check_items(request, tables, kWorker, "worker 0 (rank 1)", kServer);
    const bool push = kind == MessageKind::Push || kind == MessageKind::PushPull || kind == MessageKind::PushRows;
    // As Server::apply_pushes under ASP (applied at once), then Server::answer_reads.
    for (const auto& item : request.dense) {
      auto& table = *tables[item.table];
      if (push) {
        require_inside(item.data, item.numel * c10::elementSize(item.dtype), payload, size,
                       "an accepted dense item's data lies outside its payload");
        table.pushes[kWorker] += 1;
        table.apply_mean({at::Tensor()}, {at::from_blob(const_cast<uint8_t*>(item.data), {item.numel}, item.dtype)});
      }
    }
    for (const auto& item : request.rows) {
      auto& table = static_cast<SparseTable&>(*tables[item.table]);
      require_inside(reinterpret_cast<const uint8_t*>(item.ids), item.count * sizeof(int64_t), payload, size,
                     "an accepted rows item's ids lie outside its payload");
      if (push) {
        require_inside(item.data, item.count * item.dim * c10::elementSize(item.dtype), payload, size,
                       "an accepted rows item's gradients lie outside its payload");
        table.pushes[kWorker] += 1;
        if (item.count > 0) {
          table.apply_mean({at::from_blob(const_cast<int64_t*>(item.ids), {item.count}, at::kLong)},
                           {at::from_blob(const_cast<uint8_t*>(item.data), {item.count, item.dim}, item.dtype)});
        }
      } else if (item.count * item.dim * static_cast<int64_t>(c10::elementSize(item.dtype)) <= kLargestRead) {
        table.read_rows(item.ids, item.count);
      }
    }
  }
};

} // namespace
} // namespace torchpar::ps::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace torchpar::ps;
  fuzz::Server server;
  for (const auto& registration : fuzz::initial_tables()) {
    std::visit([&](const auto& r) { server.add(r); }, registration);
  }
  for (int message = 0; message < fuzz::kMaxMessages && size >= fuzz::kFrameBytes; ++message) {
    int64_t fields[Frame::kFields];
    std::memcpy(fields, data, fuzz::kFrameBytes);
    data += fuzz::kFrameBytes;
    size -= fuzz::kFrameBytes;
    Frame frame;
    try {
      frame = decode_frame(fields);
    } catch (const c10::Error& error) {
      fuzz::say("frame", error.what_without_backtrace());
      return 0; // a channel fails on a frame it cannot read: nothing after it is received
    }
    // A stream cut short delivers a shorter payload than announced (a channel never does; a
    // decoder must refuse it all the same). Each payload gets its own buffer of exactly its size,
    // 8-byte aligned as the channel's are; an empty one is handed over as null, as the server does.
    const size_t bytes = std::min<size_t>(size, static_cast<size_t>(frame.payload_bytes));
    const std::vector<uint8_t> payload(data, data + bytes);
    try {
      server.handle(frame.kind, bytes ? payload.data() : nullptr, bytes);
      fuzz::say(kind_name(frame.kind), "accepted");
    } catch (const c10::Error& error) {
      // Refused with its reason; the server goes on with the next message.
      fuzz::say(kind_name(frame.kind), error.what_without_backtrace());
    }
    data += bytes;
    size -= bytes;
  }
  return 0;
}
