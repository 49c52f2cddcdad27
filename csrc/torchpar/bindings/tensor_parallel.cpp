// torchpar._C.tensor_parallel: the mappings, shard construction, layer forwards and the 3-D grid under
// python/torchpar/tensor_parallel.py.
#include <torchpar/bindings/bindings.h>

#include <torchpar/tensor_parallel/cross_entropy.h>
#include <torchpar/tensor_parallel/layer_norm.h>
#include <torchpar/tensor_parallel/layers.h>
#include <torchpar/tensor_parallel/parallel_grid.h>
#include <torchpar/tensor_parallel/random.h>
#include <torchpar/tensor_parallel/sharded_parameters.h>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace torchpar::bindings {

namespace py = pybind11;
namespace tp = torchpar::tensor_parallel;

namespace {

py::object optional_tensor(const at::Tensor& tensor) {
  return tensor.defined() ? py::cast(tensor) : py::none();
}

at::Tensor tensor_or_undefined(const std::optional<at::Tensor>& tensor) { return tensor ? *tensor : at::Tensor(); }

// (weight, bias or None) from a shard function, computed without the GIL (it runs a collective).
template <typename ShardFunction>
auto linear_shards(ShardFunction shard_function) {
  return [shard_function](const tp::Group& group, int64_t in_features, int64_t out_features, bool bias,
                          const std::string& name) {
    tp::LinearShards shards;
    {
      py::gil_scoped_release release;
      shards = shard_function(group, in_features, out_features, bias, name);
    }
    return py::make_tuple(shards.weight, optional_tensor(shards.bias));
  };
}

// F.cross_entropy's reduction names.
tp::VocabParallelCrossEntropyOptions::reduction_t reduction_named(const std::string& reduction) {
  if (reduction == "none") return torch::kNone;
  if (reduction == "mean") return torch::kMean;
  TORCH_CHECK(reduction == "sum", "vocab_parallel_cross_entropy: reduction '", reduction,
              "' is not one of 'none', 'mean', 'sum'");
  return torch::kSum;
}

// A `with` block around TensorParallelRandom::fork()'s guard.
struct SplitStream {
  tp::TensorParallelRandom* random;
  std::unique_ptr<torchpar::GeneratorStateGuard> guard;
};

} // namespace

void bind_tensor_parallel(py::module_& module) {
  auto m = module.def_submodule("tensor_parallel", "C++ tensor (intra-layer) parallelism");
  // Every function waits on collectives: the GIL goes while they run.
  using Release = py::call_guard<py::gil_scoped_release>;

  m.def("copy_to_tensor_parallel", &tp::copy_to_tensor_parallel, py::arg("input"), py::arg("group"), Release());
  m.def("reduce_from_tensor_parallel", &tp::reduce_from_tensor_parallel, py::arg("input"), py::arg("group"),
        Release());
  m.def("scatter_to_tensor_parallel", &tp::scatter_to_tensor_parallel, py::arg("input"), py::arg("group"),
        py::arg("name") = "", Release());
  m.def("gather_from_tensor_parallel", &tp::gather_from_tensor_parallel, py::arg("input"), py::arg("group"),
        Release());
  m.def("scatter_to_sequence_parallel", &tp::scatter_to_sequence_parallel, py::arg("input"), py::arg("group"),
        py::arg("name") = "", Release());
  m.def("gather_from_sequence_parallel", &tp::gather_from_sequence_parallel, py::arg("input"), py::arg("group"),
        Release());
  m.def("reduce_scatter_to_sequence_parallel", &tp::reduce_scatter_to_sequence_parallel, py::arg("input"),
        py::arg("group"), py::arg("name") = "", Release());
  m.def(
      "vocab_parallel_cross_entropy",
      [](const at::Tensor& logits, const at::Tensor& target, const tp::Group& group, int64_t ignore_index,
         double label_smoothing, const std::string& reduction) {
        auto options = tp::VocabParallelCrossEntropyOptions()
                           .ignore_index(ignore_index)
                           .label_smoothing(label_smoothing)
                           .reduction(reduction_named(reduction));
        return tp::vocab_parallel_cross_entropy(logits, target, group, options);
      },
      py::arg("logits"), py::arg("target"), py::arg("group"), py::arg("ignore_index"), py::arg("label_smoothing"),
      py::arg("reduction"), Release());

  m.def("column_parallel_shards", linear_shards(&tp::column_parallel_shards), py::arg("group"),
        py::arg("in_features"), py::arg("out_features"), py::arg("bias"), py::arg("name"));
  m.def("row_parallel_shards", linear_shards(&tp::row_parallel_shards), py::arg("group"), py::arg("in_features"),
        py::arg("out_features"), py::arg("bias"), py::arg("name"));
  m.def("vocab_parallel_shard", &tp::vocab_parallel_shard, py::arg("group"), py::arg("num_embeddings"),
        py::arg("embedding_dim"), py::arg("name"), Release());
  m.def("vocab_range", &tp::vocab_range, py::arg("num_embeddings"), py::arg("rank"), py::arg("size"));

  m.def(
      "column_parallel_linear",
      [](const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
         const tp::Group& group, bool gather_output, bool sequence_parallel, const std::string& name) {
        return tp::column_parallel_linear(input, weight, tensor_or_undefined(bias), group, gather_output,
                                          sequence_parallel, name);
      },
      py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("group"), py::arg("gather_output"),
      py::arg("sequence_parallel"), py::arg("name"), Release());
  m.def(
      "row_parallel_linear",
      [](const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
         const tp::Group& group, bool input_is_parallel, bool sequence_parallel, const std::string& name) {
        return tp::row_parallel_linear(input, weight, tensor_or_undefined(bias), group, input_is_parallel,
                                       sequence_parallel, name);
      },
      py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("group"), py::arg("input_is_parallel"),
      py::arg("sequence_parallel"), py::arg("name"), Release());
  m.def("vocab_parallel_embedding", &tp::vocab_parallel_embedding, py::arg("ids"), py::arg("weight"),
        py::arg("group"), py::arg("num_embeddings"), py::arg("sequence_parallel"), py::arg("name"), Release());
  m.def(
      "sequence_parallel_layer_norm",
      [](const at::Tensor& input, std::vector<int64_t> normalized_shape, const std::optional<at::Tensor>& weight,
         const std::optional<at::Tensor>& bias, double eps, const tp::Group& group) {
        return tp::sequence_parallel_layer_norm(input, normalized_shape, tensor_or_undefined(weight),
                                                tensor_or_undefined(bias), eps, group);
      },
      py::arg("input"), py::arg("normalized_shape"), py::arg("weight"), py::arg("bias"), py::arg("eps"),
      py::arg("group"), Release());

  m.def("all_gather", &tp::collectives::all_gather, py::arg("input"), py::arg("dim"), py::arg("group"), Release());
  m.def(
      "local_slice",
      [](const at::Tensor& input, int64_t dim, const tp::Group& group, const std::string& what) {
        return tp::collectives::local_slice(input, dim, group, what);
      },
      py::arg("input"), py::arg("dim"), py::arg("group"), py::arg("what"));
  m.def(
      "clip_grad_norm",
      [](const std::vector<at::Tensor>& parameters, const std::vector<int64_t>& split_dims, double max_norm,
         const tp::Group& tensor_group, const std::optional<tp::Group>& pipeline_group) {
        TORCH_CHECK(parameters.size() == split_dims.size(), "clip_grad_norm: ", parameters.size(),
                    " parameters, ", split_dims.size(), " split dims");
        std::vector<tp::ParameterLayout> layouts;
        for (size_t i = 0; i < parameters.size(); ++i) layouts.push_back({"", parameters[i], split_dims[i]});
        return tp::clip_grad_norm(layouts, max_norm, tensor_group, pipeline_group.value_or(tp::Group()));
      },
      py::arg("parameters"), py::arg("split_dims"), py::arg("max_norm"), py::arg("tensor_group"),
      py::arg("pipeline_group"), Release());

  py::class_<SplitStream>(m, "SplitStream")
      .def("__enter__",
           [](SplitStream& self) {
             TORCH_CHECK(!self.guard, "TensorParallelRandom.fork(): this block is already open");
             self.guard = self.random->fork();
           })
      .def("__exit__", [](SplitStream& self, const py::args&) { self.guard.reset(); });
  py::class_<tp::TensorParallelRandom>(m, "TensorParallelRandom")
      .def(py::init<uint64_t, const tp::Group&>(), py::arg("seed"), py::arg("tensor_group"))
      .def(
          "fork", [](tp::TensorParallelRandom& self) { return SplitStream{&self, nullptr}; }, py::keep_alive<0, 1>());

  py::class_<tp::ParallelGrid>(m, "ParallelGrid", py::release_gil_before_calling_cpp_dtor())
      .def(py::init([](const tp::Group& world, int data, int pipeline, int tensor, const std::string& backend,
                       std::optional<std::chrono::milliseconds> timeout) {
             comm::InitOptions options;
             options.backend(backend).timeout(timeout);
             py::gil_scoped_release release;
             return std::make_unique<tp::ParallelGrid>(world, data, pipeline, tensor, options);
           }),
           py::arg("world"), py::arg("data"), py::arg("pipeline"), py::arg("tensor"), py::arg("backend"),
           py::arg("timeout"))
      .def_property_readonly("data_size", &tp::ParallelGrid::data_size)
      .def_property_readonly("pipeline_size", &tp::ParallelGrid::pipeline_size)
      .def_property_readonly("tensor_size", &tp::ParallelGrid::tensor_size)
      .def_property_readonly("data_index", &tp::ParallelGrid::data_index)
      .def_property_readonly("pipeline_index", &tp::ParallelGrid::pipeline_index)
      .def_property_readonly("tensor_index", &tp::ParallelGrid::tensor_index)
      .def_property_readonly("data_group", &tp::ParallelGrid::data_group)
      .def_property_readonly("pipeline_group", &tp::ParallelGrid::pipeline_group)
      .def_property_readonly("tensor_group", &tp::ParallelGrid::tensor_group)
      .def("rank_of", &tp::ParallelGrid::rank_of, py::arg("data_index"), py::arg("pipeline_index"),
           py::arg("tensor_index"))
      .def("__repr__", &tp::ParallelGrid::describe);
}

} // namespace torchpar::bindings
