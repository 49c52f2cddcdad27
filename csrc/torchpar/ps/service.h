#pragma once
// The parameter service's roles under one launch: the last S ranks of the job serve, the others
// train. Every rank constructs the service (it creates the service's own process groups); then
// servers call serve() and workers use client() and worker_group().
#include <torchpar/ps/client.h>
#include <torchpar/ps/server.h>

#include <torch/arg.h>

#include <optional>

namespace torchpar::ps {

struct ServiceOptions {
  // Server ranks; 0: TORCHPAR_PS_SERVERS, else 1.
  TORCH_ARG(int, num_servers) = 0;
  TORCH_ARG(Consistency, consistency) = Consistency::BSP;
  TORCH_ARG(int, staleness) = 0;
  TORCH_ARG(std::string, checkpoint_dir);
  TORCH_ARG(int64_t, checkpoint_every) = 0;
  // Requests, BSP rounds and the service's groups; unset: TORCHPAR_TIMEOUT, else 30 minutes.
  TORCH_ARG(std::optional<std::chrono::milliseconds>, timeout);
  TORCH_ARG(std::chrono::milliseconds, stats_interval) = std::chrono::seconds(30);
  // Backend of the workers' own group (for evaluation, DDP …); empty: TORCHPAR_BACKEND, else gloo.
  TORCH_ARG(std::string, worker_backend);
  TORCH_ARG(std::function<void(bool, const std::string&)>, log);
};

// S from the options or TORCHPAR_PS_SERVERS; throws naming the variable when it is unusable.
int resolve_num_servers(int requested, int world_size);

class ParameterService {
 public:
  ParameterService(const c10::intrusive_ptr<c10d::ProcessGroup>& world, ServiceOptions options = {});
  ~ParameterService();

  bool is_server() const { return server_index_ >= 0; }
  int server_index() const { return server_index_; }
  int worker_index() const { return worker_index_; }
  int num_servers() const { return num_servers_; }
  int num_workers() const { return num_workers_; }

  // Servers: serve until every worker finished or was lost.
  ServerSummary serve();
  // Workers.
  Client& client();
  const c10::intrusive_ptr<c10d::ProcessGroup>& worker_group() const { return worker_group_; }
  // Workers: tell the servers this worker is done (also done by the destructor).
  void finish();

 private:
  ServiceOptions options_;
  std::chrono::milliseconds timeout_;
  int num_servers_ = 0;
  int num_workers_ = 0;
  int server_index_ = -1;
  int worker_index_ = -1;
  std::vector<int> server_ranks_;
  std::vector<int> worker_ranks_;
  c10::intrusive_ptr<c10d::ProcessGroup> service_group_;
  c10::intrusive_ptr<c10d::ProcessGroup> worker_group_;
  std::unique_ptr<Client> client_;
};

} // namespace torchpar::ps
