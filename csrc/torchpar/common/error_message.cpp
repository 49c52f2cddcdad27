#include <torchpar/common/error_message.h>

#include <c10/util/Exception.h>

namespace torchpar {

std::string message_of(const std::exception& error) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&error)) {
    return c10_error->what_without_backtrace();
  }
  return error.what();
}

} // namespace torchpar
