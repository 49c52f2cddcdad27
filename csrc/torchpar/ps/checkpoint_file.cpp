#include <torchpar/ps/checkpoint_file.h>

#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <torchpar/common/atomic_file.h>
#include <torchpar/common/error_message.h>

namespace torchpar::ps {

std::string checkpoint_path(const std::string& directory, int server, int num_servers) {
  return directory + "/server-" + std::to_string(server) + "-of-" + std::to_string(num_servers) + ".pt";
}

void write_checkpoint_file(const std::string& path, const c10::IValue& state) {
  const auto bytes = torch::jit::pickle_save(state);
  try {
    write_file_atomically(path, bytes.data(), bytes.size());
  } catch (const c10::Error& error) {
    TORCH_CHECK(false, "torchpar.ps: checkpoint: ", error.what_without_backtrace());
  }
}

std::optional<c10::IValue> read_checkpoint_file(const std::string& path) {
  const auto bytes = read_file(path);
  if (!bytes) {
    return std::nullopt;
  }
  try {
    return torch::jit::pickle_load(std::vector<char>(bytes->begin(), bytes->end()));
  } catch (const std::exception& error) {
    TORCH_CHECK(false, "torchpar.ps: checkpoint ", path, " is unreadable: ", message_of(error));
  }
}

} // namespace torchpar::ps
