#include <torchpar/pipeline/microbatches.h>

#include <torchpar/pipeline/p2p.h>

#include <c10/util/Exception.h>

namespace torchpar::pipeline {

std::vector<Tensors> split_microbatches(const Tensors& tensors, int microbatches) {
  std::vector<Tensors> parts(microbatches);
  for (const auto& tensor : tensors) {
    auto chunks = tensor.tensor_split(microbatches);
    for (int mb = 0; mb < microbatches; ++mb) {
      parts[mb].push_back(std::move(chunks[mb]));
    }
  }
  return parts;
}

void check_equal_microbatches(const Tensors& tensors, int microbatches, const char* call, const char* what) {
  for (size_t index = 0; index < tensors.size(); ++index) {
    const auto& tensor = tensors[index];
    TORCH_CHECK(tensor.defined() && tensor.dim() > 0, "pipeline.", call, ": ", what, " ", index,
                " must be a tensor with a batch dimension");
    const int64_t batch = tensor.size(0);
    TORCH_CHECK(batch % microbatches == 0, "pipeline.", call, ": a batch of ", batch, " samples (", what, " ", index,
                " ", describe(metas_of({tensor})), ") does not split into ", microbatches,
                " equal micro-batches; use a batch size divisible by ", microbatches);
  }
}

} // namespace torchpar::pipeline
