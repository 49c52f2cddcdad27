// Tied parameters across pipeline stages kept one parameter: the copies on the ranks holding them
// start equal and, after every step's backward, each receives the sum of all copies' gradients, so
// any optimizer step (a function of the parameter, its gradient and its own state) keeps them equal.
// Megatron-LM's embedding group and DeepSpeed's TiedLayerSpec do the same for the tied embedding.
#pragma once
#include <torchpar/common/c10d_fwd.h>
#include <torchpar/pipeline/shared_parameters.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <map>
#include <string>
#include <unordered_set>
#include <vector>

namespace torchpar::pipeline {

class SharedGradients {
 public:
  // Collective over `pipeline_group`: every rank passes the same `groups` (merge_shared_parameters)
  // and cut `boundaries`; `local_layers` are this rank's layers by model index. Checks that every copy
  // has one shape, dtype and requires_grad across the ranks (refusing on every rank otherwise, before
  // any value moves), makes several copies on this rank one tensor (they share the first one's
  // storage and only it is stepped), creates one process group per set of holding ranks, and sets
  // every copy to the values of the one at the group's lowest layer.
  SharedGradients(c10::intrusive_ptr<c10d::ProcessGroup> pipeline_group, std::vector<SharedParameterGroup> groups,
                  const std::vector<int64_t>& boundaries, const std::map<int64_t, const Layer*>& local_layers,
                  at::Device control_device);

  // This rank's one tensor per group it holds: what its optimizer steps.
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  // Whether `tensor` is a further copy on this rank, standing for one of parameters() (not to be stepped).
  bool is_redundant_copy(const at::Tensor& tensor) const;
  // Whether `tensor` is one of parameters(): its gradient is final only after reduce().
  bool is_shared(const at::Tensor& tensor) const;

  // After every weight gradient of the step on this rank: adds the further copies' gradients into the
  // stepped tensor's and sums it over the ranks holding the parameter (zeros where a copy got none).
  void reduce();
  // The groups, where they live and where their values came from, one line each.
  const std::string& report() const { return report_; }
  const std::vector<SharedParameterGroup>& groups() const { return groups_; }

 private:
  struct Tie {
    SharedParameterPlacement placement;
    at::Tensor parameter;             // this rank's stepped copy; undefined where it holds none
    std::vector<at::Tensor> copies;   // further tensors of this rank sharing its storage
    size_t holders = 0;               // index into holder_groups_
  };
  struct Bucket {  // the ties reduced by one all-reduce: the same holders, the same dtype
    size_t holders = 0;
    std::vector<size_t> ties;
  };

  void check_across_ranks(const std::string& local_error, at::Device control_device);
  void create_holder_groups();
  void start_equal();

  c10::intrusive_ptr<c10d::ProcessGroup> pipeline_group_;
  std::vector<SharedParameterGroup> groups_;
  std::vector<Tie> ties_;
  std::vector<std::vector<int>> holder_ranks_;                              // distinct sets, in group order
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> holder_groups_;       // null where this rank is not in it
  std::vector<Bucket> buckets_;                                             // this rank's
  std::vector<at::Tensor> parameters_;
  std::unordered_set<const void*> shared_, redundant_;                      // TensorImpls
  std::string report_;
};

} // namespace torchpar::pipeline
