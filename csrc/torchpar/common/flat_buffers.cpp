#include <torchpar/common/flat_buffers.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/unflatten_dense_tensors.h>
#include <c10/util/irange.h>

#include <vector>

namespace torchpar {

at::Tensor flatten(at::TensorList tensors) {
  // Not at::flatten_dense_tensors: it returns a view of a lone contiguous tensor instead of a copy.
  std::vector<at::Tensor> rows;
  rows.reserve(tensors.size());
  for (const auto& tensor : tensors) {
    rows.push_back(tensor.reshape({-1}));
  }
  return at::cat(rows);
}

void unflatten_into(const at::Tensor& flat, at::TensorList targets) {
  const auto slices = at::unflatten_dense_tensors(flat, targets);
  for (const auto i : c10::irange(targets.size())) {
    // An empty target's slice comes back as a 1-D empty tensor, which need not match its shape.
    if (targets[i].numel() > 0) {
      targets[i].copy_(slices[i]);
    }
  }
}

} // namespace torchpar
