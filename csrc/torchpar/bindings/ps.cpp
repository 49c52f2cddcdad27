// torchpar._C.ps: the parameter service (roles, client, server loop) under python/torchpar/ps.py.
#include <torchpar/bindings/bindings.h>

#include <torchpar/ps/embedding.h>
#include <torchpar/ps/remote_parameters.h>
#include <torchpar/ps/service.h>
#include <torchpar/ps/sparse_table.h>

#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

namespace torchpar::bindings {

namespace py = pybind11;
namespace ps = torchpar::ps;

namespace {

std::shared_ptr<torch::jit::PythonFutureWrapper> wrap(ps::Future future) {
  return std::make_shared<torch::jit::PythonFutureWrapper>(std::move(future));
}

py::dict summary_to_dict(const ps::ServerSummary& summary) {
  py::dict result;
  result["requests"] = summary.requests;
  result["bytes_in"] = summary.bytes_in;
  result["bytes_out"] = summary.bytes_out;
  result["max_staleness"] = summary.max_staleness;
  result["reads_in_place"] = summary.reads_in_place;
  result["lost_workers"] = summary.lost_workers;
  py::list tables;
  for (const auto& table : summary.tables) {
    py::dict entry;
    entry["name"] = table.name;
    entry["sparse"] = table.sparse;
    entry["rows_touched"] = table.rows_touched;
    entry["bytes"] = table.bytes;
    tables.append(entry);
  }
  result["tables"] = tables;
  return result;
}

} // namespace

void bind_ps(py::module_& module) {
  auto m = module.def_submodule("ps", "C++ parameter-server engine");
  using Release = py::call_guard<py::gil_scoped_release>;

  py::class_<ps::OptimizerConfig>(m, "OptimizerConfig")
      .def_static("sgd", &ps::OptimizerConfig::sgd, py::arg("lr"), py::arg("momentum") = 0.0,
                  py::arg("weight_decay") = 0.0)
      .def_static("adagrad", &ps::OptimizerConfig::adagrad, py::arg("lr"), py::arg("eps") = 1e-10,
                  py::arg("initial_accumulator") = 0.0)
      .def_static("adam", &ps::OptimizerConfig::adam, py::arg("lr"), py::arg("beta1") = 0.9, py::arg("beta2") = 0.999,
                  py::arg("eps") = 1e-8)
      .def_readwrite("weight_decay", &ps::OptimizerConfig::weight_decay)
      .def_readwrite("lr", &ps::OptimizerConfig::lr)
      .def("__repr__", &ps::OptimizerConfig::describe);

  py::class_<ps::RowInitializer>(m, "RowInitializer")
      .def_static("zeros", &ps::RowInitializer::zeros)
      .def_static("uniform", &ps::RowInitializer::uniform, py::arg("low"), py::arg("high"), py::arg("seed") = 0)
      .def_static("normal", &ps::RowInitializer::normal, py::arg("mean"), py::arg("std"), py::arg("seed") = 0);

  m.def("initial_rows", &ps::initial_rows, py::arg("initializer"), py::arg("ids"), py::arg("dim"),
     "The first values of rows `ids` of a sparse table with `initializer` (float64 [n, dim]).");
  m.def("row_owner", &ps::row_owner, py::arg("id"), py::arg("num_servers"));

  py::class_<ps::Client>(m, "Client", py::release_gil_before_calling_cpp_dtor())
      .def("dense_table", &ps::Client::dense_table, py::arg("name"), py::arg("initial"), py::arg("optimizer"),
           Release())
      .def("sparse_table", &ps::Client::sparse_table, py::arg("name"), py::arg("num_rows"), py::arg("dim"),
           py::arg("optimizer"), py::arg("initializer") = ps::RowInitializer::zeros(),
           py::arg("dtype") = c10::kFloat, Release())
      .def("pull", [](ps::Client& self, const std::vector<int>& tables) { return wrap(self.pull(tables)); },
           py::arg("tables"), Release())
      .def("push",
           [](ps::Client& self, const std::vector<int>& tables, const std::vector<at::Tensor>& grads) {
             return wrap(self.push(tables, grads));
           },
           py::arg("tables"), py::arg("grads"), Release())
      .def("push_pull",
           [](ps::Client& self, const std::vector<int>& tables, const std::vector<at::Tensor>& grads) {
             return wrap(self.push_pull(tables, grads));
           },
           py::arg("tables"), py::arg("grads"), Release())
      .def("pull_rows",
           [](ps::Client& self, const std::vector<int>& tables, const std::vector<at::Tensor>& ids) {
             return wrap(self.pull_rows(tables, ids));
           },
           py::arg("tables"), py::arg("ids"), Release())
      .def("push_rows",
           [](ps::Client& self, const std::vector<int>& tables, const std::vector<at::Tensor>& ids,
              const std::vector<at::Tensor>& grads) { return wrap(self.push_rows(tables, ids, grads)); },
           py::arg("tables"), py::arg("ids"), py::arg("grads"), Release())
      .def("set_learning_rate", &ps::Client::set_learning_rate, py::arg("table"), py::arg("lr"), Release())
      .def("checkpoint", &ps::Client::checkpoint, Release())
      .def("finish", &ps::Client::finish, Release())
      .def("clock", &ps::Client::clock, py::arg("table"))
      .def("table_name", [](const ps::Client& self, int table) { return self.table(table).name; })
      .def("send_raw",
           [](ps::Client& self, int server, int64_t kind, const at::Tensor& payload) {
             return wrap(self.send_raw(server, kind, payload));
           },
           py::arg("server"), py::arg("kind"), py::arg("payload"), Release())
      .def_property_readonly("num_servers", &ps::Client::num_servers)
      .def_property_readonly("worker_index", &ps::Client::worker_index);

  // Both keep their client's Python object (and so the service) alive: keep_alive<1, 2>.
  py::class_<ps::RemoteParameters>(m, "RemoteParameters", py::release_gil_before_calling_cpp_dtor())
      .def(py::init([](ps::Client& client, const std::vector<std::string>& names,
                       const std::vector<at::Tensor>& parameters, const ps::OptimizerConfig& optimizer,
                       const std::string& prefix, size_t bucket_cap_bytes) {
             TORCH_CHECK(names.size() == parameters.size(), "RemoteParameters: ", names.size(), " names for ",
                         parameters.size(), " parameters");
             torch::OrderedDict<std::string, at::Tensor> named_parameters;
             for (size_t i = 0; i < names.size(); ++i) {
               named_parameters.insert(names[i], parameters[i]);
             }
             py::gil_scoped_release release;
             return std::make_unique<ps::RemoteParameters>(client, named_parameters, optimizer, prefix,
                                                           bucket_cap_bytes);
           }),
           py::keep_alive<1, 2>(), py::arg("client"), py::arg("names"), py::arg("parameters"), py::arg("optimizer"),
           py::arg("prefix"), py::arg("bucket_cap_bytes"))
      .def("step", &ps::RemoteParameters::step, Release())
      .def("pull", &ps::RemoteParameters::pull, Release())
      .def("set_learning_rate", &ps::RemoteParameters::set_learning_rate, py::arg("lr"), Release())
      .def_property_readonly("clock", &ps::RemoteParameters::clock)
      .def_property_readonly("buckets", &ps::RemoteParameters::buckets)
      .def("remove_hooks", &ps::RemoteParameters::remove_hooks, Release());

  py::class_<ps::EmbeddingImpl, std::shared_ptr<ps::EmbeddingImpl>>(m, "Embedding",
                                                                    py::release_gil_before_calling_cpp_dtor())
      .def(py::init([](ps::Client& client, const std::string& name, int64_t num_rows, int64_t dim,
                       const ps::OptimizerConfig& optimizer, const ps::RowInitializer& initializer,
                       c10::ScalarType dtype) {
             py::gil_scoped_release release;
             return std::make_shared<ps::EmbeddingImpl>(client, name, num_rows, dim, optimizer, initializer, dtype);
           }),
           py::keep_alive<1, 2>(), py::arg("client"), py::arg("name"), py::arg("num_rows"), py::arg("dim"),
           py::arg("optimizer"), py::arg("initializer"), py::arg("dtype"))
      .def("forward",
           [](ps::EmbeddingImpl& self, const at::Tensor& ids, bool training) {
             self.train(training);
             py::gil_scoped_release release;
             return self.forward(ids);
           },
           py::arg("ids"), py::arg("training"))
      .def("flush", &ps::EmbeddingImpl::flush, Release())
      .def_property_readonly("table", &ps::EmbeddingImpl::table);

  py::class_<ps::ParameterService>(m, "ParameterService", py::release_gil_before_calling_cpp_dtor())
      .def(py::init([](const c10::intrusive_ptr<c10d::ProcessGroup>& world, int num_servers,
                       const std::string& consistency, int staleness, const std::string& checkpoint_dir,
                       int64_t checkpoint_every, std::optional<double> timeout_s, double stats_interval_s,
                       const std::string& worker_backend, std::function<void(bool, const std::string&)> log) {
             ps::ServiceOptions options;
             options.num_servers(num_servers)
                 .consistency(ps::parse_consistency(consistency))
                 .staleness(staleness)
                 .checkpoint_dir(checkpoint_dir)
                 .checkpoint_every(checkpoint_every)
                 .stats_interval(std::chrono::milliseconds(static_cast<int64_t>(stats_interval_s * 1000)))
                 .worker_backend(worker_backend);
             if (timeout_s) {
               options.timeout(std::chrono::milliseconds(static_cast<int64_t>(*timeout_s * 1000)));
             }
             if (log) {
               // Log lines come from the server loop's thread, which holds no GIL.
               options.log([log](bool warning, const std::string& line) {
                 py::gil_scoped_acquire gil;
                 log(warning, line);
               });
             }
             py::gil_scoped_release release;
             return std::make_unique<ps::ParameterService>(world, options);
           }),
           py::arg("world"), py::arg("num_servers"), py::arg("consistency"), py::arg("staleness"),
           py::arg("checkpoint_dir"), py::arg("checkpoint_every"), py::arg("timeout_s"), py::arg("stats_interval_s"),
           py::arg("worker_backend"), py::arg("log"))
      .def_property_readonly("is_server", &ps::ParameterService::is_server)
      .def_property_readonly("server_index", &ps::ParameterService::server_index)
      .def_property_readonly("worker_index", &ps::ParameterService::worker_index)
      .def_property_readonly("num_servers", &ps::ParameterService::num_servers)
      .def_property_readonly("num_workers", &ps::ParameterService::num_workers)
      .def("serve",
           [](ps::ParameterService& self) {
             ps::ServerSummary summary;
             {
               py::gil_scoped_release release;
               summary = self.serve();
             }
             return summary_to_dict(summary);
           })
      .def("client", &ps::ParameterService::client, py::return_value_policy::reference_internal)
      .def_property_readonly("worker_group", &ps::ParameterService::worker_group)
      .def("finish", &ps::ParameterService::finish, Release());
}

} // namespace torchpar::bindings
