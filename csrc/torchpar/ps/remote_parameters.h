#pragma once
// A LibTorch module's parameters kept on the parameter servers: after backward, step() pushes every
// gradient and pulls the updated values in one round trip per server (the servers' optimizer does
// the update), so the local module always holds what the servers hold.
#include <torchpar/ps/client.h>

#include <torch/ordered_dict.h>

namespace torchpar::ps {

class RemoteParameters {
 public:
  // One dense table per parameter, named prefix + the parameter's name. Worker 0's values start
  // the tables; every worker's parameters then take the servers' values (also after a restore).
  RemoteParameters(Client& client, const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                   const OptimizerConfig& optimizer, const std::string& prefix = "");

  // Pushes the gradients (zeros for a parameter without one: every table must tick each clock),
  // pulls the new values into the parameters and clears the gradients.
  void step();
  // Copies the servers' current values into the parameters.
  void pull();
  void set_learning_rate(double lr);
  // Steps taken, counted from the servers' checkpoint after a restore.
  int64_t clock() const;

 private:
  void assign(const c10::List<at::Tensor>& values);

  Client& client_;
  std::vector<at::Tensor> parameters_;
  std::vector<int> tables_;
};

} // namespace torchpar::ps
