#include <torchpar/plan/memory_model.h>

#include <torchpar/comm/shm/layout.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace torchpar::plan {

void MemoryBreakdown::add(const std::string& what, double bytes, bool tensor) {
  const auto whole = static_cast<int64_t>(bytes);
  if (whole <= 0) return;
  for (auto& line : lines) {
    if (line.what == what && line.tensor == tensor) {
      line.bytes += whole;
      return;
    }
  }
  lines.push_back({what, whole, tensor});
}

int64_t MemoryBreakdown::tensor_bytes() const {
  int64_t bytes = 0;
  for (const auto& line : lines) bytes += line.tensor ? line.bytes : 0;
  return bytes;
}

int64_t MemoryBreakdown::total() const {
  int64_t bytes = 0;
  for (const auto& line : lines) bytes += line.bytes;
  return bytes;
}

std::string MemoryBreakdown::render() const {
  const auto mib = [](int64_t bytes) {
    char text[32];
    std::snprintf(text, sizeof text, "%9.2f MiB", static_cast<double>(bytes) / (1 << 20));
    return std::string(text);
  };
  std::ostringstream out;
  for (const auto& line : lines) {
    out << "  " << line.what << std::string(line.what.size() < 40 ? 40 - line.what.size() : 1, ' ') << mib(line.bytes)
        << (line.tensor ? "  tensors" : "  resident only") << "\n";
  }
  out << "  tensors (the allocator's peak)" << std::string(10, ' ') << mib(tensor_bytes()) << "\n"
      << "  resident set" << std::string(28, ' ') << mib(total()) << "\n";
  return out.str();
}

int64_t ring_pages(int64_t capacity, double in_flight_bytes) {
  if (capacity <= 0) return 0;
  return std::min<int64_t>(capacity, capacity / 4 + static_cast<int64_t>(in_flight_bytes));
}

int64_t shm_segment_pages(int64_t chunk_bytes, int ranks, double largest_op_bytes) {
  if (chunk_bytes <= 0 || ranks < 2) return 0;
  const double segment = static_cast<double>(comm::shm::kBufferSets) * ranks * static_cast<double>(chunk_bytes);
  return static_cast<int64_t>(std::min(segment, largest_op_bytes));
}

void add_host_lines(MemoryBreakdown& memory, const HostMemory& host, double retained_bytes) {
  if (host.keeps_freed_memory) memory.add("heap's small blocks (measured)", retained_bytes, false);
  memory.add("process overhead (measured)", static_cast<double>(host.process_overhead_bytes), false);
}

} // namespace torchpar::plan
