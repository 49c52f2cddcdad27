#include <torchpar/ps/push_buckets.h>

#include <c10/util/Exception.h>

namespace torchpar::ps {

PushBuckets::PushBuckets(std::vector<std::vector<size_t>> buckets, std::vector<std::string> names)
    : buckets_(std::move(buckets)),
      names_(std::move(names)),
      bucket_of_(names_.size(), buckets_.size()),
      ready_(names_.size(), false),
      missing_(buckets_.size()),
      pushed_(buckets_.size(), false) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (size_t index : buckets_[b]) {
      TORCH_CHECK(index < names_.size(), "RemoteParameters: bucket ", b, " names parameter ", index, " of ",
                  names_.size());
      TORCH_CHECK(bucket_of_[index] == buckets_.size(), "RemoteParameters: parameter '", names_[index],
                  "' is in two buckets");
      bucket_of_[index] = b;
    }
    missing_[b] = buckets_[b].size();
  }
  for (size_t index = 0; index < names_.size(); ++index) {
    TORCH_CHECK(bucket_of_[index] != buckets_.size(), "RemoteParameters: parameter '", names_[index],
                "' is in no bucket");
  }
}

std::optional<size_t> PushBuckets::gradient_ready(size_t index) {
  TORCH_CHECK(index < names_.size(), "RemoteParameters: no parameter ", index);
  TORCH_CHECK(!ready_[index], "RemoteParameters: parameter '", names_[index],
              "' got a second gradient before step(); call step() after each backward");
  ready_[index] = true;
  const size_t bucket = bucket_of_[index];
  if (--missing_[bucket] > 0 || pushed_[bucket]) {
    return std::nullopt;
  }
  pushed_[bucket] = true;
  return bucket;
}

std::vector<size_t> PushBuckets::finish_step() {
  std::vector<size_t> unpushed;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!pushed_[b]) {
      unpushed.push_back(b);
    }
    pushed_[b] = false;
    missing_[b] = buckets_[b].size();
  }
  ready_.assign(ready_.size(), false);
  return unpushed;
}

} // namespace torchpar::ps
