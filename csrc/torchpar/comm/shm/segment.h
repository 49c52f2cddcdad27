#pragma once
#include <cstddef>
#include <string>

namespace torchpar::comm::shm {

// A POSIX shared-memory segment mapped into this process. The name lives in /dev/shm only between
// create() and unlink(): the backend unlinks it as soon as every rank has mapped it (milliseconds
// after creation), so from then on nothing of ours stays behind after any exit, kill -9 included.
// Only a creator killed inside that window leaves the name behind.
class SharedSegment {
 public:
  // A new segment of `bytes` zeroed bytes, mode 0600; fails if the name exists.
  static SharedSegment create(const std::string& name, std::size_t bytes);
  // An existing segment, created by another rank of the same job.
  static SharedSegment open(const std::string& name, std::size_t bytes);
  static void unlink(const std::string& name);

  SharedSegment(SharedSegment&& other) noexcept;
  SharedSegment& operator=(SharedSegment&& other) noexcept;
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;
  ~SharedSegment();

  char* data() const {
    return static_cast<char*>(address_);
  }
  std::size_t size() const {
    return bytes_;
  }

 private:
  SharedSegment(void* address, std::size_t bytes) : address_(address), bytes_(bytes) {}
  void* address_ = nullptr;
  std::size_t bytes_ = 0;
};

} // namespace torchpar::comm::shm
