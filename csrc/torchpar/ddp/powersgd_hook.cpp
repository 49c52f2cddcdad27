#include <torchpar/ddp/powersgd_hook.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/irange.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <torchpar/common/flat_buffers.h>

namespace torchpar::ddp {
namespace {

constexpr double kOrthogonalizationEpsilon = 1e-8;

// Gram-Schmidt on the columns, in place.
void orthogonalize(at::Tensor& matrix) {
  const int64_t columns = matrix.size(1);
  for (const auto i : c10::irange(columns)) {
    auto column = matrix.narrow(1, i, 1);
    column.div_(column.norm() + kOrthogonalizationEpsilon);
    if (i + 1 < columns) {
      auto rest = matrix.narrow(1, i + 1, columns - i - 1);
      rest.sub_((column * rest).sum(0, /*keepdim=*/true) * column);
    }
  }
}

struct MatrixShape {
  int64_t rows, columns, rank;
};

} // namespace

PowerSGDHook::PowerSGDHook(c10::intrusive_ptr<c10d::ProcessGroup> group, PowerSGDOptions options)
    : group_(std::move(group)), options_(options) {
  TORCH_CHECK(group_, "PowerSGD hook: no process group given");
  TORCH_CHECK(options_.matrix_approximation_rank() >= 1, "PowerSGD hook: matrix_approximation_rank must be >= 1");
  // Buckets are rebuilt before the second iteration; state kept from the first would describe other
  // parameters.
  TORCH_CHECK(
      options_.start_powerSGD_iter() >= 1 || (!options_.use_error_feedback() && !options_.warm_start()),
      "PowerSGD hook: start_powerSGD_iter must be >= 1 when error feedback or warm start is on (the "
      "gradient buckets are rebuilt after the first iteration), got ", options_.start_powerSGD_iter());
}

c10::intrusive_ptr<c10::ivalue::Future> PowerSGDHook::runHook(c10d::GradBucket& bucket) {
  auto buffer = bucket.getBuffer();
  const bool compress = iteration_ >= options_.start_powerSGD_iter();
  if (bucket.isLast()) {
    ++iteration_;
  }
  if (!compress) {
    buffer.div_(group_->getSize());
    std::vector<at::Tensor> tensors{buffer};
    return group_->allreduce(tensors)->getFuture();
  }
  auto result = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  worker_.run([this, result, index = bucket.getIndex(), buffer, gradients = bucket.getGradients()]() mutable {
    try {
      compress_and_reduce(index, buffer, std::move(gradients));
      result->markCompleted(c10::IValue(buffer));
    } catch (...) {
      result->setError(std::current_exception());
    }
  });
  return result;
}

at::Tensor PowerSGDHook::parseHookResult(const c10::IValue& result) {
  return c10d::detail::parseCppCommHookResult(result);
}

at::Tensor PowerSGDHook::all_reduce_sum(at::Tensor tensor) {
  std::vector<at::Tensor> tensors{tensor};
  group_->allreduce(tensors)->wait();
  return tensor;
}

void PowerSGDHook::compress_and_reduce(size_t bucket_index, at::Tensor buffer, std::vector<at::Tensor> gradients) {
  const double world = group_->getSize();
  auto& state = states_[bucket_index];
  if (state.error.defined() && state.error.numel() != buffer.numel()) {
    state = BucketState{};  // the buckets were rebuilt: this index now holds other parameters
  }
  at::Tensor input_with_feedback;
  if (options_.use_error_feedback()) {
    if (state.error.defined()) {
      buffer.add_(state.error);
    }
    input_with_feedback = buffer.clone();
  }

  std::vector<at::Tensor> uncompressed, matrices;
  std::vector<MatrixShape> shapes;
  for (auto& gradient : gradients) {
    const int64_t rows = gradient.dim() > 1 ? gradient.size(0) : 0;
    const int64_t columns = rows ? gradient.numel() / rows : 0;
    const int64_t rank = std::min({rows, columns, options_.matrix_approximation_rank()});
    const bool worth_it =
        rows && static_cast<double>((rows + columns) * rank) * options_.min_compression_rate() <
            static_cast<double>(rows * columns);
    if (worth_it) {
      matrices.push_back(gradient.view({rows, columns}));
      shapes.push_back({rows, columns, rank});
    } else {
      uncompressed.push_back(gradient);
    }
  }

  if (state.qs.size() != matrices.size() || !options_.warm_start()) {
    state.qs.clear();
    auto generator = at::detail::createCPUGenerator(options_.seed() + bucket_index);
    for (const auto& shape : shapes) {
      auto q = at::randn({shape.columns, shape.rank}, generator, buffer.options().device(at::kCPU))
                   .to(buffer.device());
      orthogonalize(q);
      state.qs.push_back(std::move(q));
    }
  }

  // Round 1: the uncompressed tensors and P = M Q of every matrix.
  std::vector<at::Tensor> ps;
  for (const auto i : c10::irange(matrices.size())) {
    ps.push_back(at::matmul(matrices[i], state.qs[i]));
  }
  std::vector<at::Tensor> round_one = uncompressed;
  round_one.insert(round_one.end(), ps.begin(), ps.end());
  if (!round_one.empty()) {
    unflatten_into(all_reduce_sum(flatten(round_one)), round_one);
    for (auto& tensor : uncompressed) {
      tensor.div_(world);
    }
  }

  // Round 2: Q = M^T P with P orthogonalized; then M ~ P Q^T / world.
  if (!matrices.empty()) {
    for (const auto i : c10::irange(matrices.size())) {
      orthogonalize(ps[i]);
      state.qs[i] = at::matmul(matrices[i].t(), ps[i]);
    }
    unflatten_into(all_reduce_sum(flatten(state.qs)).div_(world), state.qs);
    for (const auto i : c10::irange(matrices.size())) {
      at::matmul_out(matrices[i], ps[i], state.qs[i].t());
    }
  }

  if (options_.use_error_feedback()) {
    state.error = input_with_feedback - buffer;
  }
}

} // namespace torchpar::ddp
