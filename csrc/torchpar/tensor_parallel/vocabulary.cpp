#include <torchpar/tensor_parallel/vocabulary.h>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace torchpar::tensor_parallel {

void check_in_vocabulary(const at::Tensor& ids, int64_t vocabulary, const std::string& who, const char* what) {
  if (ids.numel() == 0) return;
  const int64_t lowest = ids.min().item<int64_t>();
  const int64_t highest = ids.max().item<int64_t>();
  TORCH_CHECK(lowest >= 0 && highest < vocabulary, who, ": ", what, " ", lowest < 0 ? lowest : highest,
              " is out of range [0, ", vocabulary, ") of the vocabulary");
}

std::pair<int64_t, int64_t> vocab_range(int64_t num_embeddings, int rank, int size) {
  const int64_t per_rank = num_embeddings / size;
  return {rank * per_rank, (rank + 1) * per_rank};
}

} // namespace torchpar::tensor_parallel
