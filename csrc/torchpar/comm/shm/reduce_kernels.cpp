#include <torchpar/comm/shm/reduce_kernels.h>

#include <algorithm>
#include <functional>
#include <iterator>
#include <type_traits>

#include <ATen/core/Tensor.h>
#include <ATen/ops/bitwise_and.h>
#include <ATen/ops/bitwise_or.h>
#include <ATen/ops/add.h>
#include <ATen/ops/bitwise_xor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/logical_and.h>
#include <ATen/ops/logical_or.h>
#include <ATen/ops/logical_xor.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>
#include <ATen/ops/mul.h>
#include <c10/util/Exception.h>

namespace torchpar::comm::shm {
namespace {

using RedOp = c10d::ReduceOp::RedOpType;

bool reduced_in_float(c10::ScalarType dtype) {
  return dtype == c10::kHalf || dtype == c10::kBFloat16;
}

// out = a (op) b, all of one dtype; out may be a itself.
void combine(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, RedOp op) {
  const bool boolean = out.scalar_type() == c10::kBool;
  switch (op) {
    case RedOp::SUM:
    case RedOp::AVG:
      boolean ? at::logical_or_out(out, a, b) : at::add_out(out, a, b);
      return;
    case RedOp::PRODUCT:
      boolean ? at::logical_and_out(out, a, b) : at::mul_out(out, a, b);
      return;
    case RedOp::MIN:
      at::minimum_out(out, a, b);
      return;
    case RedOp::MAX:
      at::maximum_out(out, a, b);
      return;
    case RedOp::BAND:
      at::bitwise_and_out(out, a, b);
      return;
    case RedOp::BOR:
      at::bitwise_or_out(out, a, b);
      return;
    case RedOp::BXOR:
      boolean ? at::logical_xor_out(out, a, b) : at::bitwise_xor_out(out, a, b);
      return;
    default:
      TORCH_CHECK(false, "shm backend: unsupported reduce op ", static_cast<int>(op));
  }
}

// out = s0 (op) s1 (op) ... in source order; out must not alias any source.
void accumulate(at::Tensor& out, const std::vector<at::Tensor>& sources, RedOp op) {
  if (sources.size() == 1) {
    out.copy_(sources[0]);
  } else {
    combine(out, sources[0], sources[1], op);
    for (std::size_t i = 2; i < sources.size(); ++i) {
      combine(out, out, sources[i], op);
    }
  }
  if (op == RedOp::AVG) {
    out.div_(static_cast<double>(sources.size()));
  }
}

// Integer sums and products wrap around (two's complement), as in ATen and Gloo, instead of being
// undefined behaviour on overflow.
template <typename T, typename Op>
T wrapping(T a, T b, Op op) {
  if constexpr (std::is_integral_v<T>) {
    using Unsigned = std::make_unsigned_t<T>;
    return static_cast<T>(op(static_cast<Unsigned>(a), static_cast<Unsigned>(b)));
  } else {
    return op(a, b);
  }
}

// The common case without ATen's per-call cost (tensor views, dispatch: microseconds that dominate
// small messages): a plain loop the compiler vectorises.
template <typename T>
bool reduce_plain(T* out, const std::vector<const void*>& sources, int64_t count, RedOp op) {
  auto source = [&](std::size_t i) { return static_cast<const T*>(sources[i]); };
  // One pass over the first two sources (no copy of the first into `out` before), then one per source.
  auto fold = [&](auto combine) {
    const T* first = source(0);
    if (sources.size() == 1) {
      std::copy(first, first + count, out);
      return;
    }
    const T* second = source(1);
    for (int64_t i = 0; i < count; ++i) {
      out[i] = combine(first[i], second[i]);
    }
    for (std::size_t k = 2; k < sources.size(); ++k) {
      const T* next = source(k);
      for (int64_t i = 0; i < count; ++i) {
        out[i] = combine(out[i], next[i]);
      }
    }
  };
  switch (op) {
    case RedOp::SUM:
      fold([](T a, T b) { return wrapping<T>(a, b, std::plus<>()); });
      return true;
    case RedOp::AVG:
      if constexpr (std::is_floating_point_v<T>) {
        fold([](T a, T b) { return a + b; });
        const T scale = static_cast<T>(sources.size());
        for (int64_t i = 0; i < count; ++i) {
          out[i] /= scale;
        }
        return true;
      }
      return false;
    case RedOp::PRODUCT:
      fold([](T a, T b) { return wrapping<T>(a, b, std::multiplies<>()); });
      return true;
    case RedOp::MIN:
      // NaN propagates as in at::minimum (and Gloo): only floating types need the extra test.
      if constexpr (std::is_floating_point_v<T>) {
        fold([](T a, T b) { return (a != a || a < b) ? a : b; });
      } else {
        fold([](T a, T b) { return a < b ? a : b; });
      }
      return true;
    case RedOp::MAX:
      if constexpr (std::is_floating_point_v<T>) {
        fold([](T a, T b) { return (a != a || a > b) ? a : b; });
      } else {
        fold([](T a, T b) { return a > b ? a : b; });
      }
      return true;
    default:
      return false;
  }
}

bool reduce_without_aten(void* out, const std::vector<const void*>& sources, int64_t count, c10::ScalarType dtype,
                         RedOp op) {
  switch (dtype) {
    case c10::kFloat:
      return reduce_plain(static_cast<float*>(out), sources, count, op);
    case c10::kDouble:
      return reduce_plain(static_cast<double*>(out), sources, count, op);
    case c10::kInt:
      return reduce_plain(static_cast<int32_t*>(out), sources, count, op);
    case c10::kLong:
      return reduce_plain(static_cast<int64_t*>(out), sources, count, op);
    default:
      return false;
  }
}

} // namespace

void check_reducible(c10::ScalarType dtype, RedOp op, const char* op_name) {
  // The dtypes the kernels cover; anything else must fail here, on every rank alike, and never
  // halfway through an op on some ranks only.
  static constexpr c10::ScalarType kReducible[] = {c10::kFloat, c10::kDouble, c10::kHalf,  c10::kBFloat16,
                                                   c10::kChar,  c10::kByte,   c10::kShort, c10::kInt,
                                                   c10::kLong,  c10::kBool};
  TORCH_CHECK(std::find(std::begin(kReducible), std::end(kReducible), dtype) != std::end(kReducible),
              "shm backend: ", op_name, " cannot reduce tensors of dtype ", dtype);
  const bool floating = c10::isFloatingType(dtype);
  TORCH_CHECK(op != RedOp::PREMUL_SUM, "shm backend: ", op_name, " does not support ReduceOp.PREMUL_SUM");
  TORCH_CHECK(op <= RedOp::BXOR, "shm backend: ", op_name, ": unknown reduce op ", static_cast<int>(op));
  TORCH_CHECK(!(op == RedOp::AVG && !floating), "shm backend: ", op_name,
              " with ReduceOp.AVG needs a floating-point tensor, got ", dtype);
  TORCH_CHECK(!((op == RedOp::BAND || op == RedOp::BOR || op == RedOp::BXOR) && floating), "shm backend: ",
              op_name, " with a bitwise reduce op needs an integer or bool tensor, got ", dtype);
}

void reduce_slices(
    void* destination,
    const std::vector<const void*>& sources,
    int64_t count,
    c10::ScalarType dtype,
    RedOp op) {
  if (count == 0 || reduce_without_aten(destination, sources, count, dtype, op)) {
    return;
  }
  const auto options = at::TensorOptions().dtype(dtype);
  auto view = [&](const void* data) { return at::from_blob(const_cast<void*>(data), {count}, options); };
  at::Tensor out = view(destination);
  std::vector<at::Tensor> inputs;
  inputs.reserve(sources.size());
  const bool in_float = reduced_in_float(dtype);
  for (const void* source : sources) {
    inputs.push_back(in_float ? view(source).to(c10::kFloat) : view(source));
  }
  if (in_float) {
    at::Tensor acc = at::empty({count}, options.dtype(c10::kFloat));
    accumulate(acc, inputs, op);
    out.copy_(acc);
  } else {
    accumulate(out, inputs, op);
  }
}

} // namespace torchpar::comm::shm
