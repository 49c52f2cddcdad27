#include <torchpar/pipeline/shared_gradients.h>

#include <torchpar/comm/group_timeout.h>
#include <torchpar/comm/process_group.h>
#include <torchpar/common/control_collectives.h>
#include <torchpar/common/error_message.h>
#include <torchpar/common/flat_buffers.h>

#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <functional>
#include <sstream>

namespace torchpar::pipeline {
namespace {

// What every rank tells the others about its copy of each group, one row per group: whether it holds
// one, and its dtype, requires_grad and shape. Row 0 is the rank's own: its groups' fingerprint,
// their count, and whether it failed to find its copies.
constexpr int64_t kMaxDims = 8;
constexpr int64_t kColumns = 4 + kMaxDims;
enum Column : int64_t { kHeld = 0, kDtype = 1, kRequiresGrad = 2, kDims = 3, kSizes = 4 };
enum HeaderColumn : int64_t { kFingerprint = 0, kGroups = 1, kFailed = 2 };

std::string describe_copy(const at::Tensor& row) {
  const auto* value = row.data_ptr<int64_t>();
  std::ostringstream text;
  text << "[";
  for (int64_t d = 0; d < value[kDims]; ++d) {
    text << (d ? ", " : "") << value[kSizes + d];
  }
  text << "] " << c10::toString(static_cast<c10::ScalarType>(value[kDtype]))
       << (value[kRequiresGrad] ? "" : " (requires_grad=False)");
  return text.str();
}

std::string join(const std::vector<int>& values) {
  std::string text;
  for (int value : values) {
    text += (text.empty() ? "" : ", ") + std::to_string(value);
  }
  return text;
}

// The holders' group speaks the pipeline group's backend when torchpar can make it, Gloo otherwise
// (a group made in Python under another name).
std::string holders_backend(const c10d::ProcessGroup& group) {
  const auto name = group.getBackendName();
  return name == "gloo" || name == "nccl" || name == "shm" ? name : "gloo";
}

bool same_kind(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && a.requires_grad() == b.requires_grad();
}

} // namespace

SharedGradients::SharedGradients(c10::intrusive_ptr<c10d::ProcessGroup> pipeline_group,
                                 std::vector<SharedParameterGroup> groups, const std::vector<int64_t>& boundaries,
                                 const std::map<int64_t, const Layer*>& local_layers, at::Device control_device)
    : pipeline_group_(std::move(pipeline_group)), groups_(std::move(groups)) {
  const int ranks = pipeline_group_->getSize();
  const int rank = pipeline_group_->getRank();
  // Errors finding this rank's copies wait for the exchange below, so that every rank refuses together
  // instead of leaving the others blocked in it.
  std::string local_error;
  std::map<const void*, size_t> group_of;
  for (size_t g = 0; g < groups_.size(); ++g) {
    Tie tie;
    tie.placement = place_shared_parameters(groups_[g], boundaries, ranks);
    const auto known = std::find(holder_ranks_.begin(), holder_ranks_.end(), tie.placement.ranks);
    tie.holders = known - holder_ranks_.begin();
    if (known == holder_ranks_.end()) {
      holder_ranks_.push_back(tie.placement.ranks);
    }
    try {
      std::string first;
      for (const auto& ref : groups_[g]) {
        const auto layer = local_layers.find(ref.layer);
        if (layer == local_layers.end()) {
          continue;
        }
        const auto& tensor = layer->second->parameters[parameter_index(ref, *layer->second, ref.layer)];
        const auto [other, added] = group_of.emplace(tensor.unsafeGetTensorImpl(), g);
        TORCH_CHECK(other->second == g, "pipeline shared_parameters (rank ", rank, "): ", ref.describe(),
                    " is one tensor with a member of another group (", describe(groups_[other->second]),
                    "); list it in one group, addressed one way (by name or by position)");
        if (!added) {
          continue;  // the same tensor again: one copy
        }
        if (!tie.parameter.defined()) {
          tie.parameter = tensor;
          first = ref.describe();
          continue;
        }
        TORCH_CHECK(same_kind(tensor, tie.parameter), "pipeline shared_parameters (rank ", rank, "): ",
                    ref.describe(), " is ", tensor.sizes(), " ", tensor.scalar_type(), " requires_grad=",
                    tensor.requires_grad(), " but ", first, ", tied to it, is ", tie.parameter.sizes(), " ",
                    tie.parameter.scalar_type(), " requires_grad=", tie.parameter.requires_grad(),
                    "; tied parameters must be copies of one tensor");
        tie.copies.push_back(tensor);
      }
      TORCH_CHECK(!tie.parameter.defined() || tie.parameter.dim() <= kMaxDims, "pipeline shared_parameters (rank ",
                  rank, "): ", describe(groups_[g]), " has ", tie.parameter.dim(), " dimensions; tied parameters of at most ",
                  kMaxDims, " are supported");
    } catch (const std::exception& error) {
      if (local_error.empty()) {
        local_error = message_of(error);
      }
    }
    ties_.push_back(std::move(tie));
  }
  check_across_ranks(local_error, control_device);
  create_holder_groups();

  {
    // Further copies on this rank become views of the first one's storage: one tensor to step,
    // which the others read in their layers' forward.
    c10::NoGradGuard no_grad;
    for (auto& tie : ties_) {
      for (auto& copy : tie.copies) {
        copy.set_data(tie.parameter);
        redundant_.insert(copy.unsafeGetTensorImpl());
      }
      if (tie.parameter.defined()) {
        parameters_.push_back(tie.parameter);
        shared_.insert(tie.parameter.unsafeGetTensorImpl());
      }
    }
  }
  start_equal();

  std::map<std::pair<size_t, c10::ScalarType>, size_t> bucket_of;
  for (size_t t = 0; t < ties_.size(); ++t) {
    const auto& tie = ties_[t];
    if (!tie.parameter.defined() || !tie.parameter.requires_grad() || !holder_groups_[tie.holders]) {
      continue;
    }
    const auto [entry, added] = bucket_of.emplace(std::make_pair(tie.holders, tie.parameter.scalar_type()), buckets_.size());
    if (added) {
      buckets_.push_back({tie.holders, {}});
    }
    buckets_[entry->second].ties.push_back(t);
  }

  std::ostringstream report;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const auto& placement = ties_[g].placement;
    report << describe(groups_[g]) << ": stages " << join(placement.stages) << " on ranks " << join(placement.ranks)
           << (placement.ranks.size() > 1 ? ", gradients summed over them, values from rank " +
                                                 std::to_string(placement.source) + " at the start"
                                           : ", one tensor")
           << "\n";
  }
  report_ = report.str();
}

void SharedGradients::check_across_ranks(const std::string& local_error, at::Device control_device) {
  const int rank = pipeline_group_->getRank();
  const auto groups = static_cast<int64_t>(groups_.size());
  std::string all;
  for (const auto& group : groups_) {
    all += describe(group) + ";";
  }
  auto table = at::zeros({1 + groups, kColumns}, at::kLong);
  auto* header = table.data_ptr<int64_t>();
  header[kFingerprint] = static_cast<int64_t>(std::hash<std::string>()(all) >> 1);
  header[kGroups] = groups;
  header[kFailed] = local_error.empty() ? 0 : 1;
  for (int64_t g = 0; g < groups && local_error.empty(); ++g) {
    const auto& parameter = ties_[g].parameter;
    if (!parameter.defined()) {
      continue;
    }
    auto* row = header + (1 + g) * kColumns;
    row[kHeld] = 1;
    row[kDtype] = static_cast<int64_t>(parameter.scalar_type());
    row[kRequiresGrad] = parameter.requires_grad();
    row[kDims] = parameter.dim();
    for (int64_t d = 0; d < parameter.dim(); ++d) {
      row[kSizes + d] = parameter.size(d);
    }
  }
  const auto gathered = all_gather(*pipeline_group_, table, control_device);

  std::vector<int> failed;
  for (int r = 0; r < static_cast<int>(gathered.size()); ++r) {
    if (gathered[r][0][kFailed].item<int64_t>()) {
      failed.push_back(r);
    }
  }
  TORCH_CHECK(local_error.empty(), local_error);
  TORCH_CHECK(failed.empty(), "pipeline shared_parameters (rank ", rank, "): pipeline rank(s) ", join(failed),
              " could not find their copies of the tied parameters (their errors say why)");
  for (int r = 0; r < static_cast<int>(gathered.size()); ++r) {
    const auto* other = gathered[r].data_ptr<int64_t>();
    TORCH_CHECK(other[kFingerprint] == header[kFingerprint] && other[kGroups] == groups,
                "pipeline shared_parameters: the ranks disagree on which parameters are tied: pipeline rank ", rank,
                " has ", groups, " group(s) (", all.empty() ? "none" : all, ") and pipeline rank ", r, " has ",
                other[kGroups],
                " that differ; declare the same shared_parameters on every rank and build the same model there");
  }
  for (int64_t g = 0; g < groups; ++g) {
    const auto& placement = ties_[g].placement;
    const auto source = gathered[placement.source][1 + g];
    bool agree = true;
    std::string copies;
    for (int r : placement.ranks) {
      const auto row = gathered[r][1 + g];
      TORCH_INTERNAL_ASSERT(row[kHeld].item<int64_t>() == 1, "pipeline rank ", r, " holds no copy of ",
                            describe(groups_[g]));
      agree = agree && row.equal(source);
      copies += (copies.empty() ? "rank " : ", rank ") + std::to_string(r) + " has " + describe_copy(row);
    }
    TORCH_CHECK(agree, "pipeline shared_parameters: the tied parameters ", describe(groups_[g]),
                " differ across the pipeline ranks holding them: ", copies,
                "; tied copies must have one shape and dtype, and all be trained or all frozen");
  }
}

void SharedGradients::create_holder_groups() {
  const int ranks = pipeline_group_->getSize();
  const int rank = pipeline_group_->getRank();
  // Every rank of the pipeline creates every group, in the same order (new_group is collective over
  // its parent), and keeps those it is in.
  for (const auto& holders : holder_ranks_) {
    const bool member = std::binary_search(holders.begin(), holders.end(), rank);
    if (holders.size() < 2) {
      holder_groups_.emplace_back();
    } else if (static_cast<int>(holders.size()) == ranks) {
      holder_groups_.push_back(pipeline_group_);
    } else {
      auto group = comm::new_group(pipeline_group_, holders,
                                   comm::InitOptions()
                                       .backend(holders_backend(*pipeline_group_))
                                       .timeout(comm::group_timeout(*pipeline_group_)));
      holder_groups_.push_back(member ? group : c10::intrusive_ptr<c10d::ProcessGroup>());
    }
  }
}

void SharedGradients::start_equal() {
  c10::NoGradGuard no_grad;
  for (size_t g = 0; g < ties_.size(); ++g) {
    auto& tie = ties_[g];
    const auto& group = holder_groups_[tie.holders];
    if (!group || !tie.parameter.defined()) {
      continue;
    }
    const auto& holders = tie.placement.ranks;
    c10d::BroadcastOptions options;
    options.rootRank = static_cast<int64_t>(std::find(holders.begin(), holders.end(), tie.placement.source) - holders.begin());
    const bool contiguous = tie.parameter.is_contiguous();
    std::vector<at::Tensor> values{contiguous ? tie.parameter.detach() : tie.parameter.contiguous()};
    try {
      group->broadcast(values, options)->wait();
    } catch (const std::exception& error) {
      TORCH_CHECK(false, "pipeline shared_parameters (rank ", pipeline_group_->getRank(), "): setting ",
                  describe(groups_[g]), " to rank ", tie.placement.source, "'s values on ranks ", join(holders),
                  " failed: ", message_of(error));
    }
    if (!contiguous) {
      tie.parameter.detach().copy_(values[0]);
    }
  }
}

bool SharedGradients::is_redundant_copy(const at::Tensor& tensor) const {
  return redundant_.count(tensor.unsafeGetTensorImpl()) > 0;
}

bool SharedGradients::is_shared(const at::Tensor& tensor) const {
  return shared_.count(tensor.unsafeGetTensorImpl()) > 0;
}

void SharedGradients::reduce() {
  c10::NoGradGuard no_grad;
  for (auto& tie : ties_) {
    if (!tie.parameter.defined() || !tie.parameter.requires_grad()) {
      continue;
    }
    if (!tie.parameter.grad().defined()) {
      tie.parameter.mutable_grad() = at::zeros_like(tie.parameter);
    }
    for (auto& copy : tie.copies) {
      if (copy.grad().defined()) {
        tie.parameter.mutable_grad().add_(copy.grad());
        copy.mutable_grad() = at::Tensor();
      }
    }
  }
  std::vector<at::Tensor> flats;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (const auto& bucket : buckets_) {
    std::vector<at::Tensor> gradients;
    for (auto t : bucket.ties) {
      gradients.push_back(ties_[t].parameter.grad());
    }
    std::vector<at::Tensor> flat{flatten(gradients)};
    flats.push_back(flat[0]);
    works.push_back(holder_groups_[bucket.holders]->allreduce(flat));
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    try {
      works[b]->wait();
    } catch (const std::exception& error) {
      TORCH_CHECK(false, "pipeline (rank ", pipeline_group_->getRank(), "): summing the gradients of the tied "
                  "parameters ", describe(groups_[buckets_[b].ties.front()]), " over pipeline ranks ",
                  join(holder_ranks_[buckets_[b].holders]), " failed: ", message_of(error));
    }
    std::vector<at::Tensor> gradients;
    for (auto t : buckets_[b].ties) {
      gradients.push_back(ties_[t].parameter.grad());
    }
    unflatten_into(flats[b], gradients);
  }
}

} // namespace torchpar::pipeline
