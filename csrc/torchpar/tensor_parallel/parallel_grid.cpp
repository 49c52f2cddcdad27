#include <torchpar/tensor_parallel/parallel_grid.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>

namespace torchpar::tensor_parallel {

ParallelGrid::ParallelGrid(const c10::intrusive_ptr<c10d::ProcessGroup>& world, int data, int pipeline, int tensor,
                           const comm::InitOptions& options)
    : data_(data), pipeline_(pipeline), tensor_(tensor) {
  TORCH_CHECK(world, "ParallelGrid: no process group");
  const int size = world->getSize();
  TORCH_CHECK(data > 0 && pipeline > 0 && tensor > 0, "ParallelGrid: sizes must be positive, got data ", data,
              " × pipeline ", pipeline, " × tensor ", tensor);
  TORCH_CHECK(static_cast<int64_t>(data) * pipeline * tensor == size, "ParallelGrid: data ", data, " × pipeline ",
              pipeline, " × tensor ", tensor, " = ", static_cast<int64_t>(data) * pipeline * tensor,
              " ranks, but the process group has ", size, "; choose sizes whose product is ", size);
  world_rank_ = world->getRank();
  tensor_index_ = world_rank_ % tensor;
  pipeline_index_ = (world_rank_ / tensor) % pipeline;
  data_index_ = world_rank_ / (tensor * pipeline);

  // Every rank creates every group, in the same order (new_group is collective over `world`), and
  // keeps the one it belongs to.
  auto create = [&](int groups, int members, const std::function<int(int group, int member)>& rank_at) {
    c10::intrusive_ptr<c10d::ProcessGroup> mine;
    for (int g = 0; g < groups; ++g) {
      std::vector<int> ranks;
      for (int m = 0; m < members; ++m) ranks.push_back(rank_at(g, m));
      auto group = comm::new_group(world, ranks, options);
      if (group) mine = group;
    }
    return mine;
  };
  tensor_group_ = create(data * pipeline, tensor, [&](int g, int m) { return rank_of(g / pipeline, g % pipeline, m); });
  pipeline_group_ = create(data * tensor, pipeline, [&](int g, int m) { return rank_of(g / tensor, m, g % tensor); });
  data_group_ = create(pipeline * tensor, data, [&](int g, int m) { return rank_of(m, g / tensor, g % tensor); });
}

int ParallelGrid::rank_of(int data_index, int pipeline_index, int tensor_index) const {
  TORCH_CHECK(data_index >= 0 && data_index < data_ && pipeline_index >= 0 && pipeline_index < pipeline_ &&
                  tensor_index >= 0 && tensor_index < tensor_,
              "ParallelGrid: no rank at data ", data_index, ", pipeline ", pipeline_index, ", tensor ", tensor_index,
              " in a ", data_, " × ", pipeline_, " × ", tensor_, " grid");
  return (data_index * pipeline_ + pipeline_index) * tensor_ + tensor_index;
}

std::string ParallelGrid::describe() const {
  return "rank " + std::to_string(world_rank_) + " of " + std::to_string(data_ * pipeline_ * tensor_) + ": data " +
         std::to_string(data_index_) + "/" + std::to_string(data_) + ", pipeline " + std::to_string(pipeline_index_) +
         "/" + std::to_string(pipeline_) + ", tensor " + std::to_string(tensor_index_) + "/" + std::to_string(tensor_);
}

} // namespace torchpar::tensor_parallel
