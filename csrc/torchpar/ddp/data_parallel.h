// Single-process, multi-device data parallelism (torch.nn.DataParallel, TF's MirroredStrategy) for
// LibTorch modules: each forward splits the batch over the devices, runs a replica of the module on
// each (LibTorch's replicate / parallel_apply), and gathers the outputs; backward sums the replicas'
// gradients into the module's own parameters. Across processes or hosts use DistributedDataParallel.
#pragma once
#include <torch/arg.h>
#include <torch/nn/parallel/data_parallel.h>

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <vector>

namespace torchpar::ddp {

struct DataParallelOptions {
  // The devices to use; empty = every visible CUDA device.
  TORCH_ARG(std::vector<c10::Device>, devices);
  // Where outputs are gathered; default the first device.
  TORCH_ARG(std::optional<c10::Device>, output_device);
  // The batch dimension the input is split along.
  TORCH_ARG(int64_t, dim) = 0;
};

namespace detail {
// The devices to run on, and when that is fewer than two, the reason in words.
std::pair<std::vector<c10::Device>, std::string> choose_data_parallel_devices(std::vector<c10::Device> requested);
} // namespace detail

template <typename ModuleHolder>
class DataParallel {
 public:
  explicit DataParallel(ModuleHolder module, DataParallelOptions options = {})
      : module_(std::move(module)), options_(std::move(options)) {
    auto [devices, reason] = detail::choose_data_parallel_devices(options_.devices());
    devices_ = std::move(devices);
    single_device_reason_ = std::move(reason);
    if (!single_device_reason_.empty()) {
      TORCH_WARN("DataParallel runs on one device (", devices_.front(), "): ", single_device_reason_);
    }
    module_->to(devices_.front());
  }

  at::Tensor forward(at::Tensor input) {
    const auto output_device = options_.output_device().value_or(devices_.front());
    if (devices_.size() == 1) {
      return module_->forward(input.to(devices_.front())).to(output_device);
    }
    return torch::nn::parallel::data_parallel(module_, std::move(input), devices_, output_device, options_.dim());
  }
  at::Tensor operator()(at::Tensor input) { return forward(std::move(input)); }

  const std::vector<c10::Device>& devices() const { return devices_; }
  // Empty when more than one device is used; otherwise why not.
  const std::string& single_device_reason() const { return single_device_reason_; }
  ModuleHolder& module() { return module_; }

 private:
  ModuleHolder module_;
  DataParallelOptions options_;
  std::vector<c10::Device> devices_;
  std::string single_device_reason_;
};

} // namespace torchpar::ddp
