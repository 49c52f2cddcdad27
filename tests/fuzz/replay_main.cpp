// Runs inputs through the fuzz target without libFuzzer, so that every build replays the seed
// corpus and the reproducers of what fuzzing found (ctest): a crash found once stays fixed.
//   ps_wire_replay DIR_OR_FILE...
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

void replay(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  const std::vector<uint8_t> input{std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
  std::printf("%s (%zu bytes)\n", path.c_str(), input.size());
  std::fflush(stdout); // names the input before a crash in it
  LLVMFuzzerTestOneInput(input.data(), input.size());
}

} // namespace

int main(int argc, char** argv) {
  int replayed = 0;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path path(argv[i]);
    if (!std::filesystem::exists(path)) {
      std::fprintf(stderr, "ps_wire_replay: %s does not exist\n", argv[i]);
      return 1;
    }
    std::vector<std::filesystem::path> inputs;
    if (std::filesystem::is_directory(path)) {
      for (const auto& entry : std::filesystem::directory_iterator(path)) inputs.push_back(entry.path());
    } else {
      inputs.push_back(path);
    }
    std::sort(inputs.begin(), inputs.end());
    for (const auto& input : inputs) {
      replay(input);
      ++replayed;
    }
  }
  std::printf("replayed %d inputs\n", replayed);
  return replayed > 0 ? 0 : 1;
}
