#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <torchpar/bindings/bindings.h>
#include <torchpar/comm/backend_factory.h>
#include <torchpar/common/memfd_region.h>
#include <torchpar/comm/core_binding.h>
#include <torchpar/comm/group_timeout.h>
#include <torchpar/comm/launch_config.h>
#include <torchpar/comm/named_process_group.h>
#include <torchpar/comm/process_group.h>
#include <torchpar/comm/shm/process_group_shm.h>
#include <torchpar/comm/store.h>

namespace py = pybind11;

namespace torchpar::bindings {

void bind_comm(py::module_& module) {
  using namespace torchpar::comm;
  py::register_exception<LaunchError>(module, "LaunchError", PyExc_RuntimeError);

  py::class_<LaunchConfig>(module, "LaunchConfig")
      .def_readonly("rank", &LaunchConfig::rank)
      .def_readonly("world_size", &LaunchConfig::world_size)
      .def_readonly("local_rank", &LaunchConfig::local_rank)
      .def_readonly("local_world_size", &LaunchConfig::local_world_size)
      .def_readonly("master_addr", &LaunchConfig::master_addr)
      .def_readonly("master_port", &LaunchConfig::master_port)
      .def_readonly("restart_count", &LaunchConfig::restart_count)
      .def_readonly("use_agent_store", &LaunchConfig::use_agent_store)
      .def_readonly("bind_cores", &LaunchConfig::bind_cores);

  py::class_<CoreShare>(module, "CoreShare")
      .def_readonly("cpus", &CoreShare::cpus)
      .def_readonly("threads", &CoreShare::threads)
      .def_readonly("pinned", &CoreShare::pinned);
  module.def("bind_cores", &bind_cores, py::arg("local_rank") = py::none(), py::arg("local_world_size") = py::none(),
             "Pins every thread of this process to the local rank's share of the host's cores.");

  module.def(
      "read_launch_config",
      [](const std::map<std::string, std::string>& env, std::optional<int> rank,
         std::optional<int> world_size, bool has_store) {
        EnvLookup lookup = [&env](const std::string& name) -> std::optional<std::string> {
          auto it = env.find(name);
          return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
        };
        return read_launch_config(lookup, LaunchOverrides{rank, world_size, has_store});
      },
      py::arg("env"), py::arg("rank") = py::none(), py::arg("world_size") = py::none(),
      py::arg("has_store") = false,
      "Validates a torchrun launch described by `env` (a dict); raises LaunchError.");

  module.def(
      "resolve_timeout",
      [](std::optional<std::chrono::milliseconds> timeout) {
        return resolve_timeout(InitOptions().timeout(timeout));
      },
      py::arg("timeout") = py::none(),
      "The timeout init_process_group uses: the argument, else TORCHPAR_TIMEOUT, else 30 min.");

  module.def("host_key", &torchpar::memfd_host_key,
             "Equal for processes that can share memory through torchpar's memfd regions (same host, same boot).");

  module.def(
      "group_timeout", [](const c10::intrusive_ptr<c10d::ProcessGroup>& group) { return group_timeout(*group); },
      py::arg("group"), "How long `group`'s ops wait for a peer (its CPU backend's timeout).");

  module.def(
      "check_backend",
      [](const std::string& spec, int rank, int local_rank) {
        check_backends_usable(parse_backend_spec(spec), rank, local_rank);
      },
      py::arg("spec"), py::arg("rank"), py::arg("local_rank"),
      "Raises RuntimeError when backend `spec` is unknown or cannot run on this rank.");

  module.def(
      "connect_store", &connect_store, py::arg("config"), py::arg("timeout"),
      py::call_guard<py::gil_scoped_release>(),
      "The torchrun rendezvous store for `config`; raises LaunchError when unreachable.");

  module.def(
      "wait_for_all_ranks",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
         std::chrono::milliseconds timeout) { wait_for_all_ranks(*store, rank, world_size, timeout); },
      py::arg("store"), py::arg("rank"), py::arg("world_size"), py::arg("timeout"),
      py::call_guard<py::gil_scoped_release>());

  module.def(
      "make_shm_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout) {
        return shm::make_shm_backend(store, rank, size, timeout);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
      py::call_guard<py::gil_scoped_release>(),
      "torchpar's shared-memory c10d backend; torch.distributed creates it for backend 'shm'.");

  module.def(
      "named_process_group",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, const std::string& name,
         const c10::intrusive_ptr<c10d::Backend>& cpu_backend) -> c10::intrusive_ptr<c10d::ProcessGroup> {
        auto group = c10::make_intrusive<NamedProcessGroup>(store, rank, size, name);
        group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, cpu_backend);
        group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
        return group;
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("name"), py::arg("cpu_backend"),
      "A process group whose only backend is `cpu_backend` and which reports `name` as its backend's name.");

  module.def(
      "init_process_group",
      [](const std::string& backend, std::optional<std::chrono::milliseconds> timeout,
         std::optional<int> rank, std::optional<int> world_size,
         std::optional<c10::intrusive_ptr<c10d::Store>> store) {
        InitOptions options;
        options.backend(backend).timeout(timeout).rank(rank).world_size(world_size);
        if (store) {
          options.store(*store);
        }
        return init_process_group(options);
      },
      py::arg("backend") = "", py::arg("timeout") = py::none(), py::arg("rank") = py::none(),
      py::arg("world_size") = py::none(), py::arg("store") = py::none(),
      py::call_guard<py::gil_scoped_release>(),
      "The C++ torchpar::init_process_group: a c10d ProcessGroup not registered with "
      "torch.distributed (pass it explicitly to torchpar's C++ strategies).");
}

} // namespace torchpar::bindings
