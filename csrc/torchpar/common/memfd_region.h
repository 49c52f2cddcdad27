// Memory two processes of one host share: an anonymous memfd that its creator maps and a peer maps
// through /proc/<pid>/fd/<fd>. Nothing is named in /dev/shm, so a process killed at any moment leaves
// nothing behind.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace torchpar {

// This host and boot (host_id() and the kernel's boot id): only processes with the same key can map
// each other's regions.
std::string memfd_host_key();

// The size of a ring from environment variable `variable` (a number of bytes), `fallback` when unset;
// `zero_means` completes the error for anything else ("0 sends every payload through Gloo").
int64_t ring_bytes_from_environment(const char* variable, int64_t fallback, const char* zero_means);

class MemfdRegion {
 public:
  // A zeroed region of `bytes`; throws with the reason when the memory cannot be had.
  static MemfdRegion create(size_t bytes, const char* name);
  // Region `fd` of process `pid`, which must be `bytes` long; nothing, with the reason in `why_not`,
  // when it cannot be opened or mapped or its size differs.
  static std::optional<MemfdRegion> open(int64_t pid, int64_t fd, size_t bytes, std::string* why_not);

  MemfdRegion() = default;  // maps nothing
  MemfdRegion(MemfdRegion&& other) noexcept;
  MemfdRegion& operator=(MemfdRegion&& other) noexcept;
  MemfdRegion(const MemfdRegion&) = delete;
  MemfdRegion& operator=(const MemfdRegion&) = delete;
  ~MemfdRegion();

  void* data() const { return mapping_; }
  size_t bytes() const { return bytes_; }
  // The creator's descriptor, for a peer to open until close_descriptor(); -1 in an opened region.
  int descriptor() const { return fd_; }
  void close_descriptor();

 private:
  MemfdRegion(void* mapping, size_t bytes, int fd) : mapping_(mapping), bytes_(bytes), fd_(fd) {}
  void* mapping_ = nullptr;
  size_t bytes_ = 0;
  int fd_ = -1;
};

} // namespace torchpar
