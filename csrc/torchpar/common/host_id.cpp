#include <torchpar/common/host_id.h>

#include <unistd.h>

#include <cstdlib>

#include <c10/util/Exception.h>

namespace torchpar {

std::string host_id() {
  if (const char* configured = std::getenv("TORCHPAR_HOST_ID")) {
    return configured;
  }
  char name[256] = {};
  TORCH_CHECK(::gethostname(name, sizeof(name) - 1) == 0, "torchpar: gethostname failed");
  return name;
}

} // namespace torchpar
