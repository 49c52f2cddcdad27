// ps/push_buckets: when RemoteParameters pushes a bucket (in-process, no servers).
#include "catch_with_torch.h"

#include <torchpar/ps/push_buckets.h>

namespace ps = torchpar::ps;
using Catch::Matchers::Contains;

namespace {

ps::PushBuckets three_buckets() {
  // Reverse parameter order, as RemoteParameters assigns them: backward reaches "c" first.
  return ps::PushBuckets({{2}, {1, 0}, {3}}, {"a", "b", "c", "frozen_by_graph"});
}

} // namespace

TEST_CASE("push buckets: a bucket goes out once its last gradient is ready, exactly once") {
  auto buckets = three_buckets();
  CHECK(buckets.gradient_ready(2) == std::optional<size_t>(0));
  CHECK_FALSE(buckets.gradient_ready(1).has_value());  // bucket 1 still misses "a"
  CHECK(buckets.gradient_ready(0) == std::optional<size_t>(1));
  // "frozen_by_graph" got no gradient in this backward: step() sends its bucket.
  CHECK(buckets.finish_step() == std::vector<size_t>{2});
}

TEST_CASE("push buckets: finish_step starts the next step from nothing ready or pushed") {
  auto buckets = three_buckets();
  buckets.gradient_ready(2);
  buckets.gradient_ready(1);
  CHECK(buckets.finish_step() == std::vector<size_t>{1, 2});
  // "b" was ready last step, not this one: bucket 1 waits for both again.
  CHECK_FALSE(buckets.gradient_ready(0).has_value());
  CHECK(buckets.gradient_ready(1) == std::optional<size_t>(1));
  CHECK(buckets.gradient_ready(3) == std::optional<size_t>(2));
  CHECK(buckets.finish_step() == std::vector<size_t>{0});
  CHECK(buckets.finish_step() == std::vector<size_t>{0, 1, 2});  // a step without backward pushes all
}

TEST_CASE("push buckets: a second gradient before step() is refused, naming the parameter") {
  auto buckets = three_buckets();
  buckets.gradient_ready(1);
  CHECK_THROWS_WITH(buckets.gradient_ready(1),
                    Contains("parameter 'b' got a second gradient before step(); call step() after each backward"));
}

TEST_CASE("push buckets: a parameter in no bucket or in two is refused") {
  CHECK_THROWS_WITH(ps::PushBuckets({{0}}, {"a", "b"}), Contains("parameter 'b' is in no bucket"));
  CHECK_THROWS_WITH(ps::PushBuckets({{0}, {0, 1}}, {"a", "b"}), Contains("parameter 'a' is in two buckets"));
  CHECK_THROWS_WITH(ps::PushBuckets({{0, 5}}, {"a"}), Contains("bucket 0 names parameter 5 of 1"));
}
