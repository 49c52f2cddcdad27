#include <torchpar/pipeline/replica_gradients.h>

#include <torchpar/common/bucket_assignment.h>
#include <torchpar/common/error_message.h>
#include <torchpar/common/flat_buffers.h>

#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <iterator>

namespace torchpar::pipeline {

ReplicaGradients::ReplicaGradients(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                   std::vector<std::vector<at::Tensor>> stage_parameters, double bucket_cap_mb)
    : group_(std::move(group)) {
  const auto cap = static_cast<size_t>(bucket_cap_mb * 1024 * 1024);
  for (auto& parameters : stage_parameters) {
    if (!parameters.empty()) {
      c10::NoGradGuard no_grad;
      std::vector<at::Tensor> flat{flatten(parameters)};
      group_->broadcast(flat)->wait();
      unflatten_into(flat[0], parameters);
    }
    std::vector<at::Tensor> trained;
    std::copy_if(parameters.begin(), parameters.end(), std::back_inserter(trained),
                 [](const at::Tensor& parameter) { return parameter.requires_grad(); });
    std::vector<BucketableParameter> sizes;
    for (const auto& parameter : trained) {
      sizes.push_back({static_cast<size_t>(parameter.numel() * parameter.element_size()), parameter.scalar_type()});
    }
    std::vector<Bucket> buckets;
    for (const auto& members : assign_buckets(sizes, reverse_registration_order(trained.size()), {cap})) {
      Bucket bucket;
      for (auto index : members) {
        bucket.parameters.push_back(trained[index]);
      }
      buckets.push_back(std::move(bucket));
    }
    buckets_.push_back(std::move(buckets));
  }
}

void ReplicaGradients::launch(size_t local_stage) {
  TORCH_INTERNAL_ASSERT(local_stage < buckets_.size());
  for (auto& bucket : buckets_[local_stage]) {
    std::vector<at::Tensor> gradients;
    for (auto& parameter : bucket.parameters) {
      if (!parameter.grad().defined()) {
        parameter.mutable_grad() = at::zeros_like(parameter);
      }
      gradients.push_back(parameter.grad());
    }
    std::vector<at::Tensor> flat{flatten(gradients)};
    bucket.flat = flat[0];
    bucket.work = group_->allreduce(flat);
  }
  launched_.push_back(local_stage);
}

void ReplicaGradients::finish() {
  const double replicas = group_->getSize();
  for (auto local_stage : launched_) {
    for (auto& bucket : buckets_[local_stage]) {
      try {
        TORCH_INTERNAL_ASSERT(bucket.work, "pipeline: stage ", local_stage, "'s gradients launched twice");
        bucket.work->wait();
      } catch (const std::exception& error) {
        discard();
        TORCH_CHECK(false, "pipeline (data-parallel rank ", group_->getRank(),
                    "): averaging stage gradients over the replicas failed: ", message_of(error));
      }
      bucket.flat.div_(replicas);
      std::vector<at::Tensor> gradients;
      for (auto& parameter : bucket.parameters) {
        gradients.push_back(parameter.grad());
      }
      unflatten_into(bucket.flat, gradients);
      bucket.flat = at::Tensor();
      bucket.work.reset();
    }
  }
  launched_.clear();
}

void ReplicaGradients::discard() {
  for (auto local_stage : launched_) {
    for (auto& bucket : buckets_[local_stage]) {
      bucket.flat = at::Tensor();
      bucket.work.reset();
    }
  }
  launched_.clear();
}

} // namespace torchpar::pipeline
