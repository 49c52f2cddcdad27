// Whether every rank of a group built the same model (names, shapes, dtypes, which parameters train):
// what data-parallel wrappers (DDP, sharded data parallelism) check before they copy rank 0's values.
#pragma once
#include <torchpar/common/c10d_fwd.h>

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace torchpar {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Collective. Throws on every rank, naming the first differing entry and the ranks that differ from rank 0,
// with `who` (e.g. "DistributedDataParallel") leading the message.
void check_same_model(c10d::ProcessGroup& group, const NamedTensors& parameters, const NamedTensors& buffers,
                      at::Device device, const std::string& who);

} // namespace torchpar
