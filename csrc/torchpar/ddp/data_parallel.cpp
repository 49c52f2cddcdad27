#include <torchpar/ddp/data_parallel.h>

#include <torch/cuda.h>

namespace torchpar::ddp::detail {

std::pair<std::vector<c10::Device>, std::string> choose_data_parallel_devices(std::vector<c10::Device> requested) {
  if (!requested.empty()) {
    return {requested, requested.size() == 1 ? "only one device was requested" : ""};
  }
  const auto visible = torch::cuda::device_count();
  if (visible == 0) {
    return {{c10::Device(c10::kCPU)},
            torch::cuda::is_available()
                ? "CUDA is available but no device is visible (check CUDA_VISIBLE_DEVICES)"
                : "no CUDA device is visible (torch::cuda::device_count() == 0), so the module runs on the CPU; "
                  "a CPU has no second device to replicate onto"};
  }
  std::vector<c10::Device> devices;
  for (size_t index = 0; index < visible; ++index) {
    devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  return {devices, visible == 1 ? "only one CUDA device is visible" : ""};
}

} // namespace torchpar::ddp::detail
