#include <torchpar/comm/coalesced_in_place.h>

#include <torchpar/comm/shm/process_group_shm.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <exception>

namespace torchpar::comm {

bool reduces_coalesced_in_place(c10d::ProcessGroup& group) {
  try {
    const auto backend = group.getBackend(c10::DeviceType::CPU);
    const auto* shm = dynamic_cast<const shm::ProcessGroupShm*>(backend.get());
    return shm != nullptr && shm->single_host();
  } catch (const std::exception&) {
    return false;  // no CPU backend
  }
}

} // namespace torchpar::comm
