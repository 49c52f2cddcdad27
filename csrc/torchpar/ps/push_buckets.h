// Which of RemoteParameters' gradient buckets can be pushed: pure bookkeeping (no client, no
// autograd), so its rules are tested alone. A bucket goes out as soon as backward made every one of
// its gradients final; step() sends those backward did not reach (unused parameters push zeros).
#pragma once
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace torchpar::ps {

class PushBuckets {
 public:
  // buckets: parameter indices, each parameter in exactly one bucket; names: for error messages.
  PushBuckets(std::vector<std::vector<size_t>> buckets, std::vector<std::string> names);

  // Parameter `index` has its final gradient: the bucket this completes, if any. A second gradient
  // of a parameter before finish_step() is refused (it would be pushed as a second clock's).
  std::optional<size_t> gradient_ready(size_t index);
  // Ends the step: the buckets not yet pushed, in order; afterwards nothing is ready or pushed.
  std::vector<size_t> finish_step();

  const std::vector<std::vector<size_t>>& buckets() const { return buckets_; }

 private:
  std::vector<std::vector<size_t>> buckets_;
  std::vector<std::string> names_;
  std::vector<size_t> bucket_of_;
  std::vector<bool> ready_;
  std::vector<size_t> missing_; // per bucket: gradients not ready yet
  std::vector<bool> pushed_;
};

} // namespace torchpar::ps
