#include <torchpar/common/memfd_region.h>

#include <torchpar/common/host_id.h>

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <utility>

namespace torchpar {

std::string memfd_host_key() {
  std::ifstream file("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(file, boot_id);
  return host_id() + "/" + boot_id;
}

int64_t ring_bytes_from_environment(const char* variable, int64_t fallback, const char* zero_means) {
  const char* text = std::getenv(variable);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long long bytes = std::strtoll(text, &end, 10);
  TORCH_CHECK(*end == '\0' && bytes >= 0, variable, "=", text, ": expected a number of bytes (", zero_means, ")");
  return bytes;
}

MemfdRegion MemfdRegion::create(size_t bytes, const char* name) {
  const int fd = ::memfd_create(name, MFD_CLOEXEC);
  TORCH_CHECK(fd >= 0, "torchpar: memfd_create for ", name, " failed: ", std::strerror(errno));
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int error = errno;
    ::close(fd);
    TORCH_CHECK(false, "torchpar: ", bytes, " bytes of shared memory for ", name, ": ", std::strerror(error));
  }
  void* mapping = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mapping == MAP_FAILED) {
    const int error = errno;
    ::close(fd);
    TORCH_CHECK(false, "torchpar: mapping ", bytes, " bytes of shared memory for ", name, ": ", std::strerror(error));
  }
  return MemfdRegion(mapping, bytes, fd);
}

std::optional<MemfdRegion> MemfdRegion::open(int64_t pid, int64_t fd, size_t bytes, std::string* why_not) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int opened = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (opened < 0) {
    *why_not = "cannot open " + path + ": " + std::strerror(errno);
    return std::nullopt;
  }
  struct stat status {};
  if (::fstat(opened, &status) != 0 || static_cast<size_t>(status.st_size) != bytes) {
    ::close(opened);
    *why_not = path + " is not the peer's region (its size differs)";
    return std::nullopt;
  }
  void* mapping = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, opened, 0);
  ::close(opened);  // the mapping keeps the memory
  if (mapping == MAP_FAILED) {
    *why_not = "cannot map " + path + ": " + std::strerror(errno);
    return std::nullopt;
  }
  return MemfdRegion(mapping, bytes, -1);
}

MemfdRegion::MemfdRegion(MemfdRegion&& other) noexcept
    : mapping_(std::exchange(other.mapping_, nullptr)), bytes_(std::exchange(other.bytes_, 0)),
      fd_(std::exchange(other.fd_, -1)) {}

MemfdRegion& MemfdRegion::operator=(MemfdRegion&& other) noexcept {
  if (this != &other) {
    this->~MemfdRegion();
    mapping_ = std::exchange(other.mapping_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

MemfdRegion::~MemfdRegion() {
  close_descriptor();
  if (mapping_ != nullptr) ::munmap(mapping_, bytes_);
  mapping_ = nullptr;
}

void MemfdRegion::close_descriptor() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

} // namespace torchpar
