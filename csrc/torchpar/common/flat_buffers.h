// Many tensors as one contiguous 1-D buffer, so that a single collective moves them all.
#pragma once
#include <ATen/core/Tensor.h>

namespace torchpar {

// A new buffer holding every tensor's elements, in order; always a copy, even of a single tensor, so
// that reducing it in place leaves the tensors as they were until unflatten_into. All of one dtype.
at::Tensor flatten(at::TensorList tensors);

// Copies consecutive slices of `flat` back into `targets`, each slice shaped like its target.
void unflatten_into(const at::Tensor& flat, at::TensorList targets);

} // namespace torchpar
