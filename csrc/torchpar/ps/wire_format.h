#pragma once
// The parameter server's messages: a fixed frame (kind, request id, payload size) and a payload of
// little fields and aligned tensor data. Every payload is decoded and validated in full before a
// server touches a table, so a truncated or garbage message costs its sender an error, nothing more.
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace torchpar::ps {

// Bumped whenever a field changes; peers of another version are refused with both versions named.
constexpr int64_t kWireVersion = 4; // 2: dense items carry the table's shape; 3: payload rings; 4: shared values
constexpr int64_t kWireMagic = 0x54505053; // "TPPS"

enum class MessageKind : int64_t {
  RegisterDense = 1,
  RegisterSparse,
  Pull,
  Push,
  PushPull,
  PullRows,
  PushRows,
  SetLearningRate,
  Checkpoint,
  Finish,
  // Replies.
  Ok = 100,
  Error,
  Bye,
};
const char* kind_name(MessageKind kind);

// The first transfer of every message, of fixed size so one receive always reads it: six int64
// fields, then the payload itself when it fits (most requests), else a second transfer carries it,
// through Gloo or, between processes on one host, the sender's shared-memory ring (payload_ring.h).
// The frame's last kOfferBytes carry the sender's ring offer, once per channel.
struct Frame {
  static constexpr int64_t kFields = 6;
  static constexpr int64_t kBytes = 16384;
  static constexpr int64_t kOfferBytes = 512;
  static constexpr int64_t kInlineBytes = kBytes - kFields * 8 - kOfferBytes;
  // ring_flags: what a frame says about the payload rings of its channel.
  static constexpr int64_t kRingOffered = 1;   // the offer of the sender's ring is in the frame's last bytes
  static constexpr int64_t kRingAccepted = 2;  // the sender mapped the receiver's ring: payloads may go there
  static constexpr int64_t kRingDeclined = 4;  // the sender could not map it: payloads keep going through Gloo
  MessageKind kind = MessageKind::Ok;
  int64_t request_id = 0;
  int64_t payload_bytes = 0;
  int64_t ring_position = -1;  // where the payload starts in the sender's ring; -1: not in the ring
  int64_t ring_flags = 0;
};
void encode_frame(const Frame& frame, int64_t* fields);
// Throws when the magic or version is wrong: the peer speaks another protocol.
Frame decode_frame(const int64_t* fields);

struct ByteSpan {
  const uint8_t* data;
  size_t bytes;
};

class WireWriter {
 public:
  template <typename T>
  void put(T value) {
    append(&value, sizeof(T));
  }
  void put_string(const std::string& text);
  // Tensor data starts on an 8-byte boundary so the receiver can use it in place.
  void put_data(const void* data, size_t bytes);
  // put_data without the copy: the payload only points at the bytes, which the sender then copies once,
  // straight to where they go (a payload ring, the frame). They must stay unchanged until then.
  void put_data_view(const void* data, size_t bytes);
  void append(const void* data, size_t bytes);
  void reserve(size_t bytes) { bytes_.reserve(bytes); }
  // The payload as one buffer (viewed data copied in).
  std::vector<uint8_t> release();
  size_t size() const { return bytes_.size() + viewed_bytes_; }
  bool has_views() const { return !views_.empty(); }
  // The payload in order: the writer's own bytes with the viewed data between them.
  std::vector<ByteSpan> spans() const;
  // Those spans, one after another, into `out` (size() bytes).
  void copy_to(uint8_t* out) const;

 private:
  void align();

  std::vector<uint8_t> bytes_;
  // Viewed data and how many of bytes_ come before it.
  std::vector<std::pair<size_t, ByteSpan>> views_;
  size_t viewed_bytes_ = 0;
};

// Reads what WireWriter wrote; a read past the end throws naming the field.
class WireReader {
 public:
  WireReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  template <typename T>
  T get(const char* field) {
    T value;
    std::memcpy(&value, take(sizeof(T), field), sizeof(T));
    return value;
  }
  std::string get_string(const char* field);
  const uint8_t* get_data(size_t bytes, const char* field);
  // Throws if bytes are left over: a message longer than its fields is as malformed as a short one.
  void expect_end() const;

 private:
  const uint8_t* take(size_t bytes, const char* field);
  const uint8_t* data_;
  size_t size_;
  size_t offset_ = 0;
};

// Table dtypes on the wire; anything else is refused.
uint8_t dtype_code(c10::ScalarType dtype);
c10::ScalarType dtype_from_code(uint8_t code);

} // namespace torchpar::ps
