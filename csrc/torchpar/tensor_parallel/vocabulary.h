// How a vocabulary is split over a tensor-parallel group (VocabParallelEmbedding's rows, the logits of
// vocab_parallel_cross_entropy): rank r of t holds ids [r V/t, (r+1) V/t).
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <utility>

namespace torchpar::tensor_parallel {

// The ids [begin, end) of a vocabulary of `num_embeddings` that rank `rank` of `size` holds.
std::pair<int64_t, int64_t> vocab_range(int64_t num_embeddings, int rank, int size);
// Every entry of `ids` is in [0, vocabulary); else an error: "<who>: <what> <id> is out of range ...".
void check_in_vocabulary(const at::Tensor& ids, int64_t vocabulary, const std::string& who, const char* what);

} // namespace torchpar::tensor_parallel
