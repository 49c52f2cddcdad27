// comm/shm/reduce_kernels: the shm backend's reductions against ATen's, including the outputs the
// all-reduce uses in place (the output is this rank's input) and the second copy it shares.
#include "catch_with_torch.h"
#include <ATen/ops/div.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>
#include <ATen/ops/randint.h>

#include <torchpar/comm/shm/reduce_kernels.h>

using torchpar::comm::shm::reduce_slices;
using RedOp = c10d::ReduceOp::RedOpType;

namespace {

// In rank order, as the kernels promise; half types in float32, as they accumulate.
at::Tensor reference(const std::vector<at::Tensor>& sources, RedOp op) {
  const bool widened = sources[0].scalar_type() == c10::kHalf || sources[0].scalar_type() == c10::kBFloat16;
  at::Tensor acc = widened ? sources[0].to(c10::kFloat) : sources[0].clone();
  for (std::size_t k = 1; k < sources.size(); ++k) {
    const at::Tensor next = widened ? sources[k].to(c10::kFloat) : sources[k];
    switch (op) {
      case RedOp::SUM:
      case RedOp::AVG:
        acc = acc + next;
        break;
      case RedOp::PRODUCT:
        acc = acc * next;
        break;
      case RedOp::MIN:
        acc = at::minimum(acc, next);
        break;
      default:
        acc = at::maximum(acc, next);
    }
  }
  if (op == RedOp::AVG) {
    // Integers: truncated toward zero, as NCCL.
    acc = c10::isFloatingType(acc.scalar_type()) ? acc / static_cast<double>(sources.size())
                                                 : at::div(acc, static_cast<int64_t>(sources.size()), "trunc");
  }
  return acc.to(sources[0].scalar_type());
}

} // namespace

TEST_CASE("shm reduce kernels equal ATen's, into a source itself and a second copy, across blocks", "[shm]") {
  const std::vector<c10::ScalarType> dtypes{c10::kFloat, c10::kDouble, c10::kInt,  c10::kLong,
                                            c10::kHalf,  c10::kChar,   c10::kByte, c10::kShort};
  const std::vector<RedOp> ops{RedOp::SUM, RedOp::AVG, RedOp::PRODUCT, RedOp::MIN, RedOp::MAX};
  // Not multiples of the kernels' block (4 KiB), and one shorter than a block.
  const std::vector<int64_t> counts{1, 1000, 2049, 4 * 1024 + 3};
  for (const auto dtype : dtypes) {
    for (const auto op : ops) {
      for (const int64_t count : counts) {
        for (std::size_t world = 1; world <= 4; ++world) {
          // Small integers: products of four stay exact in every dtype, half included.
          std::vector<at::Tensor> sources;
          for (std::size_t k = 0; k < world; ++k) {
            const int64_t low = dtype == c10::kByte ? 0 : -3;
            sources.push_back(at::randint(low, 4, {count}, at::TensorOptions().dtype(dtype)));
          }
          const at::Tensor expected = reference(sources, op);
          INFO(c10::toString(dtype) << " op " << static_cast<int>(op) << " count " << count << " world " << world);
          std::vector<const void*> pointers;
          for (const auto& source : sources) {
            pointers.push_back(source.const_data_ptr());
          }
          // In place: the last rank's input is the output, as in an in-place all-reduce.
          const at::Tensor shared = at::empty_like(expected);
          reduce_slices(sources.back().data_ptr(), shared.data_ptr(), pointers, count, dtype, op);
          CHECK(at::equal(sources.back(), expected));
          CHECK(at::equal(shared, expected));
        }
      }
    }
  }
}
