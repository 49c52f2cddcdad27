// The ranks of a 3-D parallel job as a data × pipeline × tensor grid, tensor innermost: the ranks of a
// tensor group are consecutive, so with torchrun's rank order they share a host (and the shm backend).
//
//   rank = (data_index * pipeline + pipeline_index) * tensor + tensor_index
//
// Every rank of `world` constructs the grid (it creates process groups, collectively): it holds the
// rank's coordinates and its three groups. A tensor-parallel block runs on the tensor group inside a
// pipeline stage; the pipeline's stages talk over the pipeline group; gradients are averaged over the
// data group (torchpar's DDP, or the pipeline's replica averaging).
#pragma once
#include <torchpar/comm/process_group.h>

#include <string>

namespace torchpar::tensor_parallel {

class ParallelGrid {
 public:
  // data * pipeline * tensor must equal the world's size. `options` chooses the groups' backend and
  // timeout (as for torchpar::new_group).
  ParallelGrid(const c10::intrusive_ptr<c10d::ProcessGroup>& world, int data, int pipeline, int tensor,
               const comm::InitOptions& options = {});

  int data_size() const { return data_; }
  int pipeline_size() const { return pipeline_; }
  int tensor_size() const { return tensor_; }
  int data_index() const { return data_index_; }
  int pipeline_index() const { return pipeline_index_; }
  int tensor_index() const { return tensor_index_; }

  // The world rank at given coordinates.
  int rank_of(int data_index, int pipeline_index, int tensor_index) const;
  const c10::intrusive_ptr<c10d::ProcessGroup>& data_group() const { return data_group_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& pipeline_group() const { return pipeline_group_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& tensor_group() const { return tensor_group_; }
  // "rank 5 of 8: data 1/2, pipeline 0/2, tensor 1/2"
  std::string describe() const;

 private:
  int world_rank_;
  int data_, pipeline_, tensor_;
  int data_index_, pipeline_index_, tensor_index_;
  c10::intrusive_ptr<c10d::ProcessGroup> data_group_;
  c10::intrusive_ptr<c10d::ProcessGroup> pipeline_group_;
  c10::intrusive_ptr<c10d::ProcessGroup> tensor_group_;
};

} // namespace torchpar::tensor_parallel

namespace torchpar {
using tensor_parallel::ParallelGrid;
} // namespace torchpar
