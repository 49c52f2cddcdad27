#include <torchpar/tensor_parallel/mappings.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/core/WrapDimMinimal.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace torchpar::tensor_parallel {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int group_rank(const Group& group) {
  TORCH_CHECK(group, "tensor parallelism: no process group (a rank outside the tensor group?)");
  return group->getRank();
}

int group_size(const Group& group) {
  TORCH_CHECK(group, "tensor parallelism: no process group (a rank outside the tensor group?)");
  return group->getSize();
}

namespace collectives {
namespace {

void check_divisible(const at::Tensor& input, int64_t dim, int world, const std::string& what) {
  TORCH_CHECK(input.dim() > 0, what, ": a tensor of at least one dimension is needed, got a scalar");
  TORCH_CHECK(input.size(dim) % world == 0, what, ": dimension ", dim, " of a tensor of shape ", input.sizes(),
              " does not divide by the tensor-parallel size ", world, "; make it a multiple of ", world);
}

} // namespace

at::Tensor all_reduce_sum(const at::Tensor& input, const Group& group) {
  std::vector<at::Tensor> tensors{input.detach().contiguous().clone()};
  group->allreduce(tensors)->wait();
  return tensors[0];
}

at::Tensor all_reduce_max(const at::Tensor& input, const Group& group) {
  std::vector<at::Tensor> tensors{input.detach().contiguous().clone()};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  group->allreduce(tensors, options)->wait();
  return tensors[0];
}

at::Tensor all_gather(const at::Tensor& input, int64_t dim, const Group& group) {
  const int world = group_size(group);
  dim = c10::maybe_wrap_dim(dim, input.dim());
  // Gathered along dim 0 into one flat buffer (one collective), then laid side by side along `dim`.
  auto moved = input.detach().movedim(dim, 0).contiguous();
  auto sizes = moved.sizes().vec();
  sizes[0] *= world;
  auto gathered = at::empty(sizes, moved.options());
  group->_allgather_base(gathered, moved)->wait();
  return gathered.movedim(0, dim).contiguous();
}

at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, const Group& group, const std::string& what) {
  const int world = group_size(group);
  dim = c10::maybe_wrap_dim(dim, input.dim());
  check_divisible(input, dim, world, what);
  auto moved = input.detach().movedim(dim, 0).contiguous();
  auto sizes = moved.sizes().vec();
  sizes[0] /= world;
  auto block = at::empty(sizes, moved.options());
  group->_reduce_scatter_base(block, moved)->wait();
  return block.movedim(0, dim).contiguous();
}

at::Tensor local_slice(const at::Tensor& input, int64_t dim, const Group& group, const std::string& what) {
  const int world = group_size(group);
  dim = c10::maybe_wrap_dim(dim, input.dim());
  check_divisible(input, dim, world, what);
  // A copy, not a view: a shard outlives its source (a layer's full initial weight), and a custom
  // autograd function's output must not alias its input.
  return input.detach().chunk(world, dim)[group_rank(group)].clone(at::MemoryFormat::Contiguous);
}

} // namespace collectives

namespace {

Group group_of(AutogradContext* ctx) { return ctx->saved_data["group"].toCustomClass<c10d::ProcessGroup>(); }

// What an error calls the op: "<layer>: <op>" when a layer runs it, else the op the user called.
std::string caller(const std::string& name, const char* op) { return name.empty() ? op : name + ": " + op; }

// Both directions are chosen by the two members; `forward_op` runs in forward, `backward_op` on the gradient.
// Only forwards can meet a dimension that does not divide (a gradient has the shape the forward gave its
// output), so only they hear the caller's name.
template <typename Ops>
struct Conjugate : public torch::autograd::Function<Conjugate<Ops>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const Group& group,
                            const std::string& name) {
    ctx->saved_data["group"] = group;
    return Ops::forward(input, group, name);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {Ops::backward(grads[0], group_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

constexpr int64_t kLast = -1;

struct CopyOps {
  static at::Tensor forward(const at::Tensor& x, const Group&, const std::string&) { return x; }
  static at::Tensor backward(const at::Tensor& g, const Group& group) { return collectives::all_reduce_sum(g, group); }
};
struct ReduceOps {
  static at::Tensor forward(const at::Tensor& x, const Group& group, const std::string&) {
    return collectives::all_reduce_sum(x, group);
  }
  static at::Tensor backward(const at::Tensor& g, const Group&) { return g; }
};
struct ScatterLastOps {
  static at::Tensor forward(const at::Tensor& x, const Group& group, const std::string& name) {
    return collectives::local_slice(x, kLast, group, caller(name, "scatter_to_tensor_parallel"));
  }
  static at::Tensor backward(const at::Tensor& g, const Group& group) { return collectives::all_gather(g, kLast, group); }
};
struct GatherLastOps {
  static at::Tensor forward(const at::Tensor& x, const Group& group, const std::string&) {
    return collectives::all_gather(x, kLast, group);
  }
  static at::Tensor backward(const at::Tensor& g, const Group& group) {
    return collectives::local_slice(g, kLast, group, "gather_from_tensor_parallel (backward)");
  }
};
struct ScatterSequenceOps {
  static at::Tensor forward(const at::Tensor& x, const Group& group, const std::string& name) {
    return collectives::local_slice(x, 0, group, caller(name, "scatter_to_sequence_parallel"));
  }
  static at::Tensor backward(const at::Tensor& g, const Group& group) { return collectives::all_gather(g, 0, group); }
};
struct GatherSequenceOps {
  static at::Tensor forward(const at::Tensor& x, const Group& group, const std::string&) {
    return collectives::all_gather(x, 0, group);
  }
  static at::Tensor backward(const at::Tensor& g, const Group& group) {
    return collectives::reduce_scatter(g, 0, group, "gather_from_sequence_parallel (backward)");
  }
};
struct ReduceScatterSequenceOps {
  static at::Tensor forward(const at::Tensor& x, const Group& group, const std::string& name) {
    return collectives::reduce_scatter(x, 0, group, caller(name, "reduce_scatter_to_sequence_parallel"));
  }
  static at::Tensor backward(const at::Tensor& g, const Group& group) { return collectives::all_gather(g, 0, group); }
};

template <typename Ops>
at::Tensor apply(const at::Tensor& input, const Group& group, const std::string& name = "") {
  if (group_size(group) == 1) {
    return input;
  }
  return Conjugate<Ops>::apply(input, group, name);
}

} // namespace

at::Tensor copy_to_tensor_parallel(const at::Tensor& input, const Group& group) { return apply<CopyOps>(input, group); }
at::Tensor reduce_from_tensor_parallel(const at::Tensor& input, const Group& group) {
  return apply<ReduceOps>(input, group);
}
at::Tensor scatter_to_tensor_parallel(const at::Tensor& input, const Group& group, const std::string& name) {
  return apply<ScatterLastOps>(input, group, name);
}
at::Tensor gather_from_tensor_parallel(const at::Tensor& input, const Group& group) {
  return apply<GatherLastOps>(input, group);
}
at::Tensor scatter_to_sequence_parallel(const at::Tensor& input, const Group& group, const std::string& name) {
  return apply<ScatterSequenceOps>(input, group, name);
}
at::Tensor gather_from_sequence_parallel(const at::Tensor& input, const Group& group) {
  return apply<GatherSequenceOps>(input, group);
}
at::Tensor reduce_scatter_to_sequence_parallel(const at::Tensor& input, const Group& group, const std::string& name) {
  return apply<ReduceScatterSequenceOps>(input, group, name);
}

} // namespace torchpar::tensor_parallel
