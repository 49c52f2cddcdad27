// How a batch is cut into micro-batches: the one cut that step() and forward() share.
#pragma once
#include <torchpar/pipeline/layer.h>

#include <vector>

namespace torchpar::pipeline {

// Each tensor cut along dimension 0 into `microbatches` contiguous parts, returned per micro-batch
// (part k of every tensor, in the tensors' order). As at::tensor_split cuts: when the batch does not
// divide, the first batch % microbatches parts hold one sample more; with fewer samples than
// micro-batches, the last parts are empty.
std::vector<Tensors> split_microbatches(const Tensors& tensors, int microbatches);

// step() scales each micro-batch's loss by 1/microbatches, which is the batch's mean loss only when
// the micro-batches are equal: throws, naming `call` and the tensor (`what` and its index in
// `tensors`) with its shape, unless every tensor has a batch dimension divisible by `microbatches`.
void check_equal_microbatches(const Tensors& tensors, int microbatches, const char* call, const char* what);

} // namespace torchpar::pipeline
