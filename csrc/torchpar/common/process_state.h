// What became of another process on this machine, for errors that name the rank that died or stopped.
#pragma once
#include <cstdint>

namespace torchpar {

enum class ProcessState {
  Running,  // or sleeping: it may still take part
  Stopped,  // SIGSTOP, or a debugger: silent until continued
  Exited,   // gone, or a zombie waiting to be reaped: it will never take part again
};

// Only meaningful for a process of this PID namespace (see pid_namespace).
ProcessState process_state(int pid);
// This process's PID namespace, to tell whether another process's pid means anything here.
uint64_t pid_namespace();

} // namespace torchpar
