#include <torchpar/comm/group_timeout.h>

#include <torchpar/comm/shm/process_group_shm.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <exception>

namespace torchpar::comm {

std::chrono::milliseconds group_timeout(c10d::ProcessGroup& group) {
  try {
    const auto backend = group.getBackend(c10::DeviceType::CPU);
    if (const auto* shm = dynamic_cast<const shm::ProcessGroupShm*>(backend.get())) return shm->timeout();
    return backend->getBackendOptions()->timeout;
  } catch (const std::exception&) {
    return std::chrono::minutes(30);  // c10d's default, for a backend that does not say
  }
}

} // namespace torchpar::comm
