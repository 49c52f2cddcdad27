#include "ps_wire_fuzz.h"

namespace torchpar::ps::fuzz {
namespace {

// The initial values of the dense tables (their values never decide what is accepted).
alignas(8) const uint8_t kZeros[16 * 8] = {};

DenseRegistration dense(std::string name, c10::ScalarType dtype, std::vector<int64_t> shape, int64_t begin,
                        int64_t end, OptimizerConfig optimizer) {
  return DenseRegistration{std::move(name), dtype, std::move(shape), begin, end, optimizer, kZeros};
}

} // namespace

std::vector<Registration> initial_tables() {
  return {
      dense("weight", c10::kFloat, {3, 4}, 4, 12, OptimizerConfig::sgd(0.1, 0.9, 0.01)),
      dense("bias", c10::kDouble, {5}, 0, 5, OptimizerConfig::adam(0.01)),
      SparseRegistration{"embedding", c10::kFloat, 1000, 4, RowInitializer::uniform(-0.1, 0.1, 7),
                         OptimizerConfig::adagrad(0.1)},
      SparseRegistration{"items", c10::kDouble, 50, 2, RowInitializer::zeros(), OptimizerConfig::adam(0.01)},
  };
}

} // namespace torchpar::ps::fuzz
