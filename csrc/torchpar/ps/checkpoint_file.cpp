#include <torchpar/ps/checkpoint_file.h>

#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <unistd.h>

namespace torchpar::ps {

std::string checkpoint_path(const std::string& directory, int server, int num_servers) {
  return directory + "/server-" + std::to_string(server) + "-of-" + std::to_string(num_servers) + ".pt";
}

void write_checkpoint_file(const std::string& path, const c10::IValue& state) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  const auto bytes = torch::jit::pickle_save(state);
  const std::string temporary = path + ".tmp";
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TORCH_CHECK(fd >= 0, "torchpar.ps: cannot write checkpoint ", temporary, ": ", std::strerror(errno));
  size_t written = 0;
  while (written < bytes.size()) {
    const auto n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = errno;
      ::close(fd);
      TORCH_CHECK(false, "torchpar.ps: writing checkpoint ", temporary, " failed: ", std::strerror(error));
    }
    written += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  TORCH_CHECK(synced, "torchpar.ps: flushing checkpoint ", temporary, " failed: ", std::strerror(errno));
  TORCH_CHECK(std::rename(temporary.c_str(), path.c_str()) == 0, "torchpar.ps: renaming ", temporary, " to ", path,
              " failed: ", std::strerror(errno));
}

std::optional<c10::IValue> read_checkpoint_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return std::nullopt;
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  try {
    return torch::jit::pickle_load(bytes);
  } catch (const std::exception& error) {
    TORCH_CHECK(false, "torchpar.ps: checkpoint ", path, " is unreadable: ", error.what());
  }
}

} // namespace torchpar::ps
