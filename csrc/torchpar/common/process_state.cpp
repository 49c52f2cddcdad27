#include <torchpar/common/process_state.h>

#include <signal.h>
#include <sys/stat.h>

#include <cerrno>
#include <fstream>
#include <string>

namespace torchpar {

ProcessState process_state(int pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) {
    return ProcessState::Exited;
  }
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) {
    return ProcessState::Exited;
  }
  // "pid (name) S ...": the name may hold spaces and parentheses; the state follows the last ')'.
  const auto close = text.rfind(')');
  const char state = close != std::string::npos && close + 2 < text.size() ? text[close + 2] : 'R';
  if (state == 'Z' || state == 'X') {
    return ProcessState::Exited;
  }
  return state == 'T' || state == 't' ? ProcessState::Stopped : ProcessState::Running;
}

uint64_t pid_namespace() {
  static const uint64_t ours = [] {
    struct stat info {};
    return ::stat("/proc/self/ns/pid", &info) == 0 ? static_cast<uint64_t>(info.st_ino) : uint64_t{0};
  }();
  return ours;
}

} // namespace torchpar
