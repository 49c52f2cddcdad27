#include <torchpar/ps/service.h>

#include <torchpar/comm/process_group.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdlib>
#include <numeric>

namespace torchpar::ps {

int resolve_num_servers(int requested, int world_size) {
  int servers = requested;
  std::string source = "num_servers";
  if (servers == 0) {
    if (const char* text = std::getenv("TORCHPAR_PS_SERVERS"); text && *text) {
      source = "TORCHPAR_PS_SERVERS";
      char* end = nullptr;
      servers = static_cast<int>(std::strtol(text, &end, 10));
      TORCH_CHECK(end && *end == '\0' && servers > 0, "torchpar.ps: TORCHPAR_PS_SERVERS='", text,
                  "' is not a positive number of server ranks");
    } else {
      servers = 1;
    }
  }
  TORCH_CHECK(servers > 0 && servers < world_size, "torchpar.ps: ", source, "=", servers, " leaves ",
              world_size - servers, " worker ranks in a job of ", world_size,
              " (the last S ranks serve, the others train; at least one of each)");
  return servers;
}

ParameterService::ParameterService(const c10::intrusive_ptr<c10d::ProcessGroup>& world, ServiceOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(world, "torchpar.ps: no process group");
  const int size = world->getSize();
  const int rank = world->getRank();
  num_servers_ = resolve_num_servers(options_.num_servers(), size);
  num_workers_ = size - num_servers_;
  TORCH_CHECK(options_.staleness() >= 0, "torchpar.ps: staleness ", options_.staleness(), " is negative");
  comm::InitOptions group_options;
  if (options_.timeout()) group_options.timeout(*options_.timeout());
  timeout_ = comm::resolve_timeout(group_options);
  group_options.timeout(timeout_);
  for (int r = 0; r < size; ++r) {
    (r < num_workers_ ? worker_ranks_ : server_ranks_).push_back(r);
  }
  if (rank < num_workers_) {
    worker_index_ = rank;
  } else {
    server_index_ = rank - num_workers_;
  }
  std::vector<int> everyone(size);
  std::iota(everyone.begin(), everyone.end(), 0);
  // Messages are host bytes: the service's own group is Gloo whatever the job's backend.
  service_group_ = comm::new_group(world, everyone, comm::InitOptions(group_options).backend("gloo"));
  worker_group_ = comm::new_group(world, worker_ranks_, comm::InitOptions(group_options).backend(options_.worker_backend()));
  if (!is_server()) {
    client_ = std::make_unique<Client>(service_group_, worker_index_, server_ranks_, timeout_);
  }
}

ParameterService::~ParameterService() {
  client_.reset();
}

ServerSummary ParameterService::serve() {
  TORCH_CHECK(is_server(), "torchpar.ps: serve() on worker rank ", worker_index_, " (servers are the last ",
              num_servers_, " ranks)");
  ServerOptions server;
  server.consistency = options_.consistency();
  server.staleness = options_.staleness();
  server.checkpoint_dir = options_.checkpoint_dir();
  server.checkpoint_every = options_.checkpoint_every();
  server.timeout = timeout_;
  server.stats_interval = options_.stats_interval();
  server.log = options_.log();
  return run_server(service_group_, server_index_, num_servers_, worker_ranks_, server);
}

Client& ParameterService::client() {
  TORCH_CHECK(client_, "torchpar.ps: client() on server ", server_index_, " (workers are the first ", num_workers_,
              " ranks)");
  return *client_;
}

void ParameterService::finish() {
  if (client_) client_->finish();
}

} // namespace torchpar::ps
