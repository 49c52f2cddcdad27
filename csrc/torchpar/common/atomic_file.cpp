#include <torchpar/common/atomic_file.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <c10/util/Exception.h>

namespace torchpar {
namespace {

void flush_folder(const std::filesystem::path& folder) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

} // namespace

void write_file_atomically(const std::string& path, const void* bytes, size_t size) {
  const std::filesystem::path target(path);
  const auto folder = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  std::filesystem::create_directories(folder);
  // A name of this process's own: ranks or threads writing files side by side never share one.
  const std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TORCH_CHECK(fd >= 0, "cannot write ", temporary, ": ", std::strerror(errno));
  const auto* data = static_cast<const char*>(bytes);
  size_t written = 0;
  while (written < size) {
    const auto n = ::write(fd, data + written, size - written);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      const int error = errno;
      ::close(fd);
      std::remove(temporary.c_str());
      TORCH_CHECK(false, "writing ", temporary, " failed: ", std::strerror(error));
    }
    written += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  const int sync_error = errno;
  ::close(fd);
  if (!synced || std::rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = synced ? errno : sync_error;
    std::remove(temporary.c_str());
    TORCH_CHECK(false, synced ? "renaming " : "flushing ", temporary, synced ? " to " + path : std::string(),
                " failed: ", std::strerror(error));
  }
  flush_folder(folder);
}

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    TORCH_CHECK(!std::filesystem::exists(path), "cannot read ", path, ": ", std::strerror(errno));
    return std::nullopt;
  }
  std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  TORCH_CHECK(!file.bad(), "reading ", path, " failed");
  return bytes;
}

} // namespace torchpar
