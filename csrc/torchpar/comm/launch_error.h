#pragma once
#include <stdexcept>

namespace torchpar::comm {

// A launch that cannot work: a torchrun variable missing or inconsistent, a master that cannot be
// reached, ranks that never joined. Unlike c10::Error its what() carries no C++ backtrace: the
// reader is someone who typed a command line, so the message is one line saying what is wrong and
// what to do. Python sees it as torchpar.LaunchError (a RuntimeError).
class LaunchError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

} // namespace torchpar::comm
