// Compiled with USE_C10D_GLOO and the gloo headers of the system (see cmake/TorchparFindTorch.cmake
// for why that is safe): only this file ever sees ProcessGroupGloo.hpp, and it only calls
// ProcessGroupGloo's out-of-line functions, which run torch's own copy of gloo.
#include <torchpar/comm/gloo_backend.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace torchpar::comm {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int world_size,
    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, options);
}

} // namespace torchpar::comm
