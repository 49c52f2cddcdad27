#pragma once
// A LibTorch module's parameters kept on the parameter servers, one dense table each. Gradients are
// pushed in buckets (reverse parameter order, as DDP's: roughly the order backward produces them),
// each with a pull of the new values, as soon as backward has made every gradient of the bucket
// final — so communication overlaps the rest of backward and a bucket is one message per server.
// step() sends what backward did not reach, waits for the values and writes them into the module.
// torchpar.ps.RemoteParameters (Python) is this class.
#include <torchpar/ps/client.h>
#include <torchpar/ps/push_buckets.h>

#include <torch/ordered_dict.h>

#include <memory>
#include <mutex>

namespace torchpar {
class GradientReadyHooks;
} // namespace torchpar

namespace torchpar::ps {

class RemoteParameters {
 public:
  // The parameters that require grad, each a table named prefix + its name. Worker 0's values start
  // the tables (unless the servers restored them); every worker's parameters then take the servers'
  // values. A bucket closes once it holds bucket_cap_bytes.
  RemoteParameters(Client& client, const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                   const OptimizerConfig& optimizer, const std::string& prefix = "",
                   size_t bucket_cap_bytes = size_t{25} << 20);
  ~RemoteParameters();
  RemoteParameters(const RemoteParameters&) = delete;
  RemoteParameters& operator=(const RemoteParameters&) = delete;

  // Pushes the buckets backward did not (zeros for a parameter without a gradient: every table must
  // tick each clock), waits for every bucket's values, writes them into the parameters and clears the
  // gradients. The first failed bucket's error is raised after the others were written.
  void step();
  // Copies the servers' current values into the parameters.
  void pull();
  void set_learning_rate(double lr);
  // Steps taken, counted from the servers' checkpoint after a restore.
  int64_t clock() const;
  // The parameters' names, bucket by bucket, in the order they are pushed.
  std::vector<std::vector<std::string>> buckets() const;
  // Stops pushing from backward: step() then pushes everything.
  void remove_hooks();

 private:
  void push_bucket(size_t bucket); // the caller holds mutex_
  void assign(const std::vector<size_t>& indices, const c10::List<at::Tensor>& values);

  Client& client_;
  std::vector<std::string> names_;
  std::vector<at::Tensor> parameters_;
  std::vector<int> tables_;
  std::mutex mutex_; // backward's hooks (autograd threads) and the caller's step()
  PushBuckets buckets_;
  std::vector<std::pair<size_t, Future>> in_flight_;
  std::unique_ptr<GradientReadyHooks> hooks_; // last: its hooks use the members above
};

} // namespace torchpar::ps
