// The communication of tensor (intra-layer) parallelism as autograd functions, Megatron-LM's conjugate
// pairs: each forward collective has the collective that undoes it in backward. On a group of one rank
// every function is the identity.
//
//   copy_to_tensor_parallel        identity                       | all-reduce (sum) of the gradient
//   reduce_from_tensor_parallel    all-reduce (sum)               | identity
//   scatter_to_tensor_parallel     this rank's slice of the last  | all-gather along the last dim
//                                  dim
//   gather_from_tensor_parallel    all-gather along the last dim  | this rank's slice of the gradient
//
// Sequence parallelism splits activations along dim 0 (the sequence dim, Megatron's [s, b, h] layout)
// in the regions between tensor-parallel layers (LayerNorm, dropout):
//
//   scatter_to_sequence_parallel        this rank's slice of dim 0   | all-gather along dim 0
//   gather_from_sequence_parallel       all-gather along dim 0       | reduce-scatter along dim 0
//   reduce_scatter_to_sequence_parallel reduce-scatter along dim 0   | all-gather along dim 0
//
// A split dimension must divide by the group's size; the error names the dimension and the sizes, and
// the layer when a layer passes its `name` ("blocks.3.mlp.down: reduce_scatter_to_sequence_parallel: ...").
#pragma once
#include <torchpar/common/c10d_fwd.h>

#include <ATen/core/Tensor.h>

#include <string>

namespace torchpar::tensor_parallel {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

at::Tensor copy_to_tensor_parallel(const at::Tensor& input, const Group& group);
at::Tensor reduce_from_tensor_parallel(const at::Tensor& input, const Group& group);
at::Tensor scatter_to_tensor_parallel(const at::Tensor& input, const Group& group, const std::string& name = "");
at::Tensor gather_from_tensor_parallel(const at::Tensor& input, const Group& group);

at::Tensor scatter_to_sequence_parallel(const at::Tensor& input, const Group& group, const std::string& name = "");
at::Tensor gather_from_sequence_parallel(const at::Tensor& input, const Group& group);
at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& input, const Group& group,
                                               const std::string& name = "");

// The collectives themselves, without autograd: new tensors, the input left as it was.
namespace collectives {
at::Tensor all_reduce_sum(const at::Tensor& input, const Group& group);
at::Tensor all_reduce_max(const at::Tensor& input, const Group& group);
at::Tensor all_gather(const at::Tensor& input, int64_t dim, const Group& group);
// `what` names the caller in the error of a dimension that does not divide by the group's size.
at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, const Group& group, const std::string& what);
// A copy of this rank's equal slice of `input` along `dim`.
at::Tensor local_slice(const at::Tensor& input, int64_t dim, const Group& group, const std::string& what);
} // namespace collectives

int group_rank(const Group& group);
int group_size(const Group& group);

} // namespace torchpar::tensor_parallel
