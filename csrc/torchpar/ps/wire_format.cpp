#include <torchpar/ps/wire_format.h>

#include <c10/util/Exception.h>

namespace torchpar::ps {

const char* kind_name(MessageKind kind) {
  switch (kind) {
    case MessageKind::RegisterDense: return "register dense table";
    case MessageKind::RegisterSparse: return "register sparse table";
    case MessageKind::Pull: return "pull";
    case MessageKind::Push: return "push";
    case MessageKind::PushPull: return "push_pull";
    case MessageKind::PullRows: return "pull_rows";
    case MessageKind::PushRows: return "push_rows";
    case MessageKind::SetLearningRate: return "set learning rate";
    case MessageKind::Checkpoint: return "checkpoint";
    case MessageKind::Finish: return "finish";
    case MessageKind::Ok: return "ok";
    case MessageKind::Error: return "error";
    case MessageKind::Bye: return "bye";
  }
  return "unknown";
}

void encode_frame(const Frame& frame, int64_t* fields) {
  fields[0] = (kWireMagic << 16) | kWireVersion;
  fields[1] = static_cast<int64_t>(frame.kind);
  fields[2] = frame.request_id;
  fields[3] = frame.payload_bytes;
  fields[4] = frame.ring_position;
  fields[5] = frame.ring_flags;
}

Frame decode_frame(const int64_t* fields) {
  TORCH_CHECK((fields[0] >> 16) == kWireMagic, "torchpar.ps: a message without the parameter-server magic number (",
              fields[0], "): the peer does not speak this protocol");
  TORCH_CHECK((fields[0] & 0xffff) == kWireVersion, "torchpar.ps: wire format version ", (fields[0] & 0xffff),
              " from the peer, this process speaks version ", kWireVersion);
  TORCH_CHECK(fields[3] >= 0 && fields[3] < (int64_t{1} << 40), "torchpar.ps: message announces ", fields[3],
              " payload bytes");
  constexpr int64_t kRingFlags = Frame::kRingOffered | Frame::kRingAccepted | Frame::kRingDeclined;
  TORCH_CHECK(fields[4] >= -1 && (fields[5] & ~kRingFlags) == 0, "torchpar.ps: a frame with ring position ",
              fields[4], " and ring flags ", fields[5]);
  return Frame{static_cast<MessageKind>(fields[1]), fields[2], fields[3], fields[4], fields[5]};
}

void WireWriter::append(const void* data, size_t bytes) {
  const auto* begin = static_cast<const uint8_t*>(data);
  bytes_.insert(bytes_.end(), begin, begin + bytes);
}

void WireWriter::put_string(const std::string& text) {
  put<uint32_t>(static_cast<uint32_t>(text.size()));
  append(text.data(), text.size());
}

void WireWriter::align() {
  bytes_.resize(bytes_.size() + (8 - size() % 8) % 8, 0);
}

void WireWriter::put_data(const void* data, size_t bytes) {
  align();
  append(data, bytes);
}

void WireWriter::put_data_view(const void* data, size_t bytes) {
  align();
  if (bytes == 0) return;
  views_.emplace_back(bytes_.size(), ByteSpan{static_cast<const uint8_t*>(data), bytes});
  viewed_bytes_ += bytes;
}

std::vector<ByteSpan> WireWriter::spans() const {
  std::vector<ByteSpan> spans;
  size_t own = 0;
  for (const auto& [before, view] : views_) {
    if (before > own) spans.push_back({bytes_.data() + own, before - own});
    spans.push_back(view);
    own = before;
  }
  if (bytes_.size() > own) spans.push_back({bytes_.data() + own, bytes_.size() - own});
  return spans;
}

void WireWriter::copy_to(uint8_t* out) const {
  for (const auto& span : spans()) {
    std::memcpy(out, span.data, span.bytes);
    out += span.bytes;
  }
}

std::vector<uint8_t> WireWriter::release() {
  if (views_.empty()) return std::move(bytes_);
  std::vector<uint8_t> flat(size());
  copy_to(flat.data());
  bytes_.clear();
  views_.clear();
  viewed_bytes_ = 0;
  return flat;
}

const uint8_t* WireReader::take(size_t bytes, const char* field) {
  TORCH_CHECK(bytes <= size_ - offset_, "torchpar.ps: truncated message: field '", field, "' needs ", bytes,
              " bytes at offset ", offset_, ", the message has ", size_ - offset_, " left");
  const uint8_t* at = data_ + offset_;
  offset_ += bytes;
  return at;
}

std::string WireReader::get_string(const char* field) {
  const auto length = get<uint32_t>(field);
  const auto* text = take(length, field);
  return std::string(reinterpret_cast<const char*>(text), length);
}

const uint8_t* WireReader::get_data(size_t bytes, const char* field) {
  const size_t aligned = (offset_ + 7) / 8 * 8;
  TORCH_CHECK(aligned <= size_, "torchpar.ps: truncated message before field '", field, "'");
  offset_ = aligned;
  return take(bytes, field);
}

void WireReader::expect_end() const {
  TORCH_CHECK(offset_ == size_, "torchpar.ps: malformed message: ", size_ - offset_,
              " bytes left over after the last field");
}

uint8_t dtype_code(c10::ScalarType dtype) {
  TORCH_CHECK(dtype == c10::kFloat || dtype == c10::kDouble,
              "torchpar.ps: tables hold float32 or float64 values, not ", c10::toString(dtype));
  return dtype == c10::kFloat ? 1 : 2;
}

c10::ScalarType dtype_from_code(uint8_t code) {
  TORCH_CHECK(code == 1 || code == 2, "torchpar.ps: unknown dtype code ", int(code), " (1: float32, 2: float64)");
  return code == 1 ? c10::kFloat : c10::kDouble;
}

} // namespace torchpar::ps
