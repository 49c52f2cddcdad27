// What a caught exception says, for wrapping into torchpar's own error messages.
#pragma once
#include <exception>
#include <string>

namespace torchpar {

// Without the C++ backtrace that c10::Error's what() carries: wrapped messages stay readable.
std::string message_of(const std::exception& error);

} // namespace torchpar
