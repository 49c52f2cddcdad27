#include <torchpar/common/generator_state.h>

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

namespace torchpar {

GeneratorStateGuard::GeneratorStateGuard(const at::Tensor& state, at::Tensor* advanced)
    : generator_(at::detail::getDefaultCPUGenerator()), advanced_(advanced) {
  std::lock_guard<std::mutex> lock(generator_.mutex());
  saved_ = generator_.get_state();
  generator_.set_state(state);
}

GeneratorStateGuard::~GeneratorStateGuard() {
  std::lock_guard<std::mutex> lock(generator_.mutex());
  if (advanced_) {
    *advanced_ = generator_.get_state();
  }
  generator_.set_state(saved_);
}

} // namespace torchpar
