#include <torchpar/comm/backend_factory.h>

#include <sstream>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <torchpar/comm/gloo_backend.h>
#include <torchpar/comm/nccl_backend.h>
#include <torchpar/comm/shm/process_group_shm.h>

namespace torchpar::comm {
namespace {

constexpr const char* kKnownBackends = "'gloo', 'nccl', 'shm' or a list such as 'cpu:shm,cuda:nccl'";

void check_known(const std::string& name, const std::string& spec) {
  TORCH_CHECK(
      name == "gloo" || name == "nccl" || name == "shm",
      "torchpar: unknown backend '", name, "' in '", spec, "'; use ", kKnownBackends);
}

c10::DeviceType parse_device(const std::string& device, const std::string& spec) {
  if (device == "cpu") {
    return c10::DeviceType::CPU;
  }
  if (device == "cuda") {
    return c10::DeviceType::CUDA;
  }
  TORCH_CHECK(false, "torchpar: unknown device '", device, "' in backend '", spec, "'; use cpu or cuda");
}

void check_device_supported(const BackendChoice& choice, const std::string& spec) {
  TORCH_CHECK(!(choice.name == "shm" && choice.device != c10::DeviceType::CPU),
              "torchpar: backend 'shm' serves CPU tensors only ('", spec, "'); use e.g. 'cpu:shm,cuda:nccl'");
  TORCH_CHECK(!(choice.name == "nccl" && choice.device != c10::DeviceType::CUDA),
              "torchpar: backend 'nccl' serves CUDA tensors only ('", spec, "'); use e.g. 'cpu:gloo,cuda:nccl'");
}

#ifndef TORCHPAR_HAS_NCCL
[[noreturn]] void nccl_not_compiled() {
  TORCH_CHECK(
      false, "torchpar: backend 'nccl' is not available: this libtorchpar was built against a torch ",
      "without CUDA or without NCCL headers; use backend 'gloo'");
}
#endif

} // namespace

std::vector<BackendChoice> parse_backend_spec(const std::string& spec) {
  std::vector<BackendChoice> choices;
  if (spec.find(':') == std::string::npos) {
    check_known(spec, spec);
    if (spec != "nccl") {
      choices.push_back({c10::DeviceType::CPU, spec});
    }
    if (spec != "shm") {
      choices.push_back({c10::DeviceType::CUDA, spec});
    }
    return choices;
  }
  std::istringstream entries(spec);
  std::string entry;
  while (std::getline(entries, entry, ',')) {
    const auto colon = entry.find(':');
    TORCH_CHECK(
        colon != std::string::npos, "torchpar: backend entry '", entry, "' in '", spec,
        "' is not device:backend; use ", kKnownBackends);
    BackendChoice choice{parse_device(entry.substr(0, colon), spec), entry.substr(colon + 1)};
    check_known(choice.name, spec);
    check_device_supported(choice, spec);
    for (const auto& earlier : choices) {
      TORCH_CHECK(earlier.device != choice.device, "torchpar: backend '", spec, "' names a device twice");
    }
    choices.push_back(choice);
  }
  return choices;
}

void check_backends_usable(const std::vector<BackendChoice>& choices, int rank, int local_rank) {
  for (const auto& choice : choices) {
    if (choice.name != "nccl") {
      continue;
    }
#ifdef TORCHPAR_HAS_NCCL
    check_nccl_usable(rank, local_rank);
#else
    nccl_not_compiled();
#endif
  }
}

c10::intrusive_ptr<c10d::Backend> make_backend(
    const std::string& name,
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int world_size,
    int local_rank,
    std::chrono::milliseconds timeout) {
  if (name == "gloo") {
    return make_gloo_backend(store, rank, world_size, timeout);
  }
  if (name == "shm") {
    return shm::make_shm_backend(store, rank, world_size, timeout);
  }
  TORCH_CHECK(name == "nccl", "torchpar: unknown backend '", name, "'; use 'gloo', 'nccl' or 'shm'");
#ifdef TORCHPAR_HAS_NCCL
  return make_nccl_backend(store, rank, world_size, local_rank, timeout);
#else
  nccl_not_compiled();
#endif
}

} // namespace torchpar::comm
