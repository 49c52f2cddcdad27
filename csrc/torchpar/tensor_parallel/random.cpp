#include <torchpar/tensor_parallel/random.h>

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

namespace torchpar::tensor_parallel {

TensorParallelRandom::TensorParallelRandom(uint64_t seed, const Group& tensor_group) {
  auto split = at::detail::createCPUGenerator(seed + kSplitStreamOffset + static_cast<uint64_t>(group_rank(tensor_group)));
  split_state_ = split.get_state();
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_current_seed(seed);
}

std::unique_ptr<GeneratorStateGuard> TensorParallelRandom::fork() {
  return std::make_unique<GeneratorStateGuard>(split_state_, &split_state_);
}

} // namespace torchpar::tensor_parallel
