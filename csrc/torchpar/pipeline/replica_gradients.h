// Pipeline x data parallelism: the same stage on several replicas averages its gradients over the
// data-parallel group. A stage's gradients are final once its last micro-batch's weight gradients
// exist; its all-reduces start then, in flat buckets, while the rest of the pipeline drains.
#pragma once
#include <torchpar/common/c10d_fwd.h>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <vector>

namespace torchpar::pipeline {

class ReplicaGradients {
 public:
  // `stage_parameters`: the parameters of each of this rank's stages. Broadcasts replica 0's values
  // so that every replica starts from the same model.
  ReplicaGradients(c10::intrusive_ptr<c10d::ProcessGroup> group, std::vector<std::vector<at::Tensor>> stage_parameters,
                   double bucket_cap_mb);

  // Starts the all-reduce of local stage `local_stage`'s gradients.
  void launch(size_t local_stage);
  // Waits for every launched all-reduce and writes the averages back into .grad.
  void finish();
  // After a failed step: forget what was launched.
  void discard();

 private:
  struct Bucket {
    std::vector<at::Tensor> parameters;
    at::Tensor flat;
    c10::intrusive_ptr<c10d::Work> work;
  };

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::vector<std::vector<Bucket>> buckets_;  // per local stage
  std::vector<size_t> launched_;
};

} // namespace torchpar::pipeline
