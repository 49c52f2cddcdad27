#include <torchpar/common/control_collectives.h>

#include <ATen/ops/empty_like.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace torchpar {

at::Tensor all_reduce_sum(c10d::ProcessGroup& group, const at::Tensor& tensor, at::Device device) {
  std::vector<at::Tensor> tensors{tensor.to(device)};
  group.allreduce(tensors)->wait();
  return tensors[0].cpu();
}

std::vector<at::Tensor> all_gather(c10d::ProcessGroup& group, const at::Tensor& tensor, at::Device device) {
  std::vector<at::Tensor> input{tensor.to(device)};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < group.getSize(); ++r) {
    output[0].push_back(at::empty_like(input[0]));
  }
  group.allgather(output, input)->wait();
  std::vector<at::Tensor> gathered;
  for (auto& copy : output[0]) {
    gathered.push_back(copy.cpu());
  }
  return gathered;
}

at::Tensor broadcast(c10d::ProcessGroup& group, const at::Tensor& tensor, at::Device device, int root) {
  std::vector<at::Tensor> tensors{tensor.to(device)};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  group.broadcast(tensors, options)->wait();
  return tensors[0].cpu();
}

} // namespace torchpar
