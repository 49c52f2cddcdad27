// Every rank contributes [r*4, r*4+1, r*4+2, r*4+3] (r = its rank); after a sum all-reduce each
// rank checks the result against the closed form and prints it.
//   torchrun --nproc-per-node=2 --no-python ./allreduce_demo
#include <iostream>
#include <sstream>

#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torchpar/torchpar.h>

int main() {
  try {
    auto pg = torchpar::init_process_group();
    const int rank = pg->getRank();
    const int world = pg->getSize();
    constexpr int64_t kLength = 4;

    std::vector<at::Tensor> tensors{at::arange(kLength, at::kDouble) + rank * kLength};
    pg->allreduce(tensors)->wait();

    // sum over r of (i + r*L) = world*i + L*world*(world-1)/2
    const auto expected =
        at::arange(kLength, at::kDouble) * world + kLength * world * (world - 1) / 2.0;
    const bool correct = at::allclose(tensors[0], expected);
    std::ostringstream values;
    for (int64_t i = 0; i < kLength; ++i) {
      values << (i ? ", " : "") << tensors[0][i].item<double>();
    }
    std::cout << "rank " << rank << "/" << world << ": all_reduce(sum) = [" << values.str() << "] "
              << (correct ? "correct" : "WRONG") << std::endl;
    return correct ? 0 : 1;
  } catch (const torchpar::LaunchError& e) {
    std::cerr << "allreduce_demo: " << e.what() << std::endl;
    return 2;
  }
}
