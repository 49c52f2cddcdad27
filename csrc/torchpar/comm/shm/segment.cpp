#include <torchpar/comm/shm/segment.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include <c10/util/Exception.h>

namespace torchpar::comm::shm {
namespace {

void* map(int fd, std::size_t bytes, const std::string& name) {
  void* address = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  ::close(fd);
  TORCH_CHECK(address != MAP_FAILED, "shm backend: cannot map shared segment ", name, " (", bytes,
              " bytes): ", std::strerror(error));
  return address;
}

} // namespace

SharedSegment SharedSegment::create(const std::string& name, std::size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "shm backend: cannot create shared segment ", name, ": ", std::strerror(errno));
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int error = errno;
    ::close(fd);
    ::shm_unlink(name.c_str());
    TORCH_CHECK(false, "shm backend: cannot size shared segment ", name, " to ", bytes, " bytes: ",
                std::strerror(error), " (is /dev/shm large enough?)");
  }
  try {
    return SharedSegment(map(fd, bytes, name), bytes);
  } catch (...) {
    ::shm_unlink(name.c_str());
    throw;
  }
}

SharedSegment SharedSegment::open(const std::string& name, std::size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "shm backend: cannot open shared segment ", name, ": ", std::strerror(errno),
              " (all ranks of a group must run on one host)");
  return SharedSegment(map(fd, bytes, name), bytes);
}

void SharedSegment::unlink(const std::string& name) {
  ::shm_unlink(name.c_str());
}

SharedSegment::SharedSegment(SharedSegment&& other) noexcept
    : address_(std::exchange(other.address_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

SharedSegment& SharedSegment::operator=(SharedSegment&& other) noexcept {
  if (this != &other) {
    if (address_ != nullptr) {
      ::munmap(address_, bytes_);
    }
    address_ = std::exchange(other.address_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

SharedSegment::~SharedSegment() {
  if (address_ != nullptr) {
    ::munmap(address_, bytes_);
  }
}

} // namespace torchpar::comm::shm
