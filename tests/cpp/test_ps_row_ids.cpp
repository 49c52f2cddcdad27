// ps/row_ids: the distinct ids of a sparse operation and its gradients summed per id, against ATen.
#include "catch_with_torch.h"

#include <torchpar/ps/row_ids.h>

#include <ATen/ops/index_add.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>

namespace ps = torchpar::ps;

TEST_CASE("ps row ids: each id once in first-seen order, and every position's index among them") {
  const std::vector<int64_t> ids = {7, 3, 7, 7, 9, 3, 0};
  const auto distinct = ps::distinct_ids(ids.data(), static_cast<int64_t>(ids.size()));
  CHECK(distinct.ids == std::vector<int64_t>{7, 3, 9, 0});
  const auto* inverse = distinct.inverse.const_data_ptr<int64_t>();
  CHECK(std::vector<int64_t>(inverse, inverse + ids.size()) == std::vector<int64_t>{0, 1, 0, 0, 2, 1, 3});
  CHECK(ps::distinct_ids(nullptr, 0).ids.empty());
}

TEST_CASE("ps row ids: repeated ids' rows summed as index_add_ sums them, in float and double") {
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    const auto ids = at::randint(0, 50, {4096}, at::kLong);
    const auto rows = at::randn({4096, 32}, dtype);
    const auto distinct = ps::distinct_ids(ids.const_data_ptr<int64_t>(), ids.numel());
    const auto count = static_cast<int64_t>(distinct.ids.size());
    const auto summed = ps::sum_rows(rows, distinct.inverse, count);
    const auto expected = at::zeros({count, 32}, dtype).index_add_(0, distinct.inverse, rows);
    CHECK(summed.scalar_type() == dtype);
    CHECK(summed.allclose(expected, 1e-6, 1e-5));
  }
  // Rows that are not contiguous (a transposed view) are read as their values, not their storage.
  const auto rows = at::randn({3, 4}).t();
  const std::vector<int64_t> ids = {1, 1, 0, 1};
  const auto distinct = ps::distinct_ids(ids.data(), 4);
  CHECK(ps::sum_rows(rows, distinct.inverse, 2).equal(at::zeros({2, 3}).index_add_(0, distinct.inverse, rows)));
}
