// ps/messages and ps/request_checks: a request decodes only when it is whole, and a registration or a
// learning rate the tables could not use is refused (pure, in-process).
#include <cmath>
#include <cstring>

#include "catch_with_torch.h"
#include <ATen/ops/zeros.h>

#include <torchpar/ps/dense_table.h>
#include <torchpar/ps/messages.h>
#include <torchpar/ps/request_checks.h>

namespace ps = torchpar::ps;
using Catch::Matchers::Contains;

namespace {

std::vector<uint8_t> dense_push_payload(const std::vector<float>& grad) {
  ps::WireWriter writer;
  ps::DenseItem item{0, 0, c10::kFloat, {static_cast<int64_t>(grad.size())}, static_cast<int64_t>(grad.size()),
                     reinterpret_cast<const uint8_t*>(grad.data())};
  ps::encode_dense_items(writer, {item}, /*with_data=*/true);
  return writer.release();
}

} // namespace

TEST_CASE("a request decodes only when every field is there and nothing is left over") {
  const std::vector<float> grad{1, 2, 3, 4, 5};
  const auto payload = dense_push_payload(grad);
  const auto request = ps::decode_request(ps::MessageKind::Push, payload.data(), payload.size());
  REQUIRE(request.dense.size() == 1);
  CHECK(request.dense[0].numel == 5);
  CHECK(request.dense[0].shape == std::vector<int64_t>{5});
  float decoded[5];
  std::memcpy(decoded, request.dense[0].data, sizeof(decoded));
  CHECK(decoded[4] == 5);

  for (size_t cut = 0; cut < payload.size(); ++cut) {
    CHECK_THROWS_WITH(ps::decode_request(ps::MessageKind::Push, payload.data(), cut), Contains("truncated"));
  }
  auto longer = payload;
  longer.push_back(0);
  CHECK_THROWS_WITH(ps::decode_request(ps::MessageKind::Push, longer.data(), longer.size()), Contains("left over"));
  auto bad_dtype = payload;
  bad_dtype[4 + 4 + 8] = 9; // item count, table id, clock, then the dtype code
  CHECK_THROWS_WITH(ps::decode_request(ps::MessageKind::Push, bad_dtype.data(), bad_dtype.size()),
                    Contains("dtype code 9"));
  CHECK_THROWS_WITH(ps::decode_request(static_cast<ps::MessageKind>(77), payload.data(), payload.size()),
                    Contains("unknown request kind 77"));
  int64_t frame[ps::Frame::kFields] = {0, 3, 1, 0};
  CHECK_THROWS_WITH(ps::decode_frame(frame), Contains("magic"));
}

TEST_CASE("a payload that views its data holds the bytes a copying one holds, data on 8-byte boundaries") {
  const std::vector<uint8_t> odd{1, 2, 3};  // leaves the next data unaligned
  const std::vector<float> first{1.5f, 2.5f, 3.5f};
  const std::vector<double> second{-1.0, 7.0};
  ps::WireWriter copying, viewing;
  for (auto* writer : {&copying, &viewing}) writer->put<uint8_t>(9);
  copying.put_data(odd.data(), odd.size());
  viewing.put_data_view(odd.data(), odd.size());
  for (auto* writer : {&copying, &viewing}) writer->put<int32_t>(-4);
  copying.put_data(first.data(), first.size() * sizeof(float));
  viewing.put_data_view(first.data(), first.size() * sizeof(float));
  copying.put_data(second.data(), second.size() * sizeof(double));
  viewing.put_data_view(second.data(), second.size() * sizeof(double));
  viewing.put_data_view(second.data(), 0);  // nothing to view: no span
  for (auto* writer : {&copying, &viewing}) writer->put<uint16_t>(77);

  CHECK_FALSE(copying.has_views());
  REQUIRE(viewing.has_views());
  CHECK(viewing.size() == copying.size());
  std::vector<uint8_t> joined;
  size_t viewed = 0;
  for (const auto& span : viewing.spans()) {
    CHECK(span.bytes > 0);
    if (span.data == odd.data() || span.data == reinterpret_cast<const uint8_t*>(first.data()) ||
        span.data == reinterpret_cast<const uint8_t*>(second.data())) {
      ++viewed;
      CHECK(joined.size() % 8 == 0);  // where the reader's get_data looks for it
    }
    joined.insert(joined.end(), span.data, span.data + span.bytes);
  }
  CHECK(viewed == 3);
  const auto copied = copying.release();
  CHECK(joined == copied);
  CHECK(viewing.release() == copied);
}

// Each was accepted before, and then made every update of the table throw (the wire fuzzer's first
// finding: an Adam beta1 of -1e300, so that 1 - beta1 overflowed float32), or drew rows outside the
// distributions' preconditions.

TEST_CASE("a registration is refused when its optimizer could not step the table or its initializer draw rows") {
  auto register_sparse = [](const ps::OptimizerConfig& optimizer, const ps::RowInitializer& initializer) {
    ps::WireWriter writer;
    ps::encode_registration(writer, ps::SparseRegistration{"e", c10::kFloat, 10, 4, initializer, optimizer});
    const auto payload = writer.release();
    ps::decode_request(ps::MessageKind::RegisterSparse, payload.data(), payload.size());
  };
  const auto adam = ps::OptimizerConfig::adam(0.01);
  const auto uniform = ps::RowInitializer::uniform(-0.1, 0.1);
  CHECK_NOTHROW(register_sparse(adam, uniform));
  CHECK_NOTHROW(register_sparse(ps::OptimizerConfig::adagrad(0.1), ps::RowInitializer::normal(0, 0.01)));
  CHECK_THROWS_WITH(register_sparse(ps::OptimizerConfig::adam(0.01, -1e300), uniform),
                    Contains("table 'e'") && Contains("beta1 -1e+300 is not in [0, 1)"));
  CHECK_THROWS_WITH(register_sparse(ps::OptimizerConfig::adam(0.01, 0.9, 1.0), uniform), Contains("beta2 1 is not"));
  // lr fits in float32, the first step's lr / (1 - beta1) does not.
  CHECK_THROWS_WITH(register_sparse(ps::OptimizerConfig::adam(1e38, 0.99), uniform),
                    Contains("the first step's size lr / (1 - beta1)") && Contains("(Float)"));
  CHECK_THROWS_WITH(register_sparse(ps::OptimizerConfig::sgd(std::nan("")), uniform), Contains("lr nan is not"));
  CHECK_THROWS_WITH(register_sparse(ps::OptimizerConfig::adagrad(0.1, -1), uniform), Contains("eps -1 is not"));
  CHECK_THROWS_WITH(register_sparse(adam, ps::RowInitializer::uniform(1, -1)),
                    Contains("uniform initializer over [1, -1)"));
  CHECK_THROWS_WITH(register_sparse(adam, ps::RowInitializer::uniform(0, INFINITY)), Contains("uniform initializer"));
  CHECK_THROWS_WITH(register_sparse(adam, ps::RowInitializer::normal(0, -1)), Contains("normal initializer"));
}

TEST_CASE("a learning rate is refused when the table's dtype cannot hold its steps") {
  ps::Tables tables;
  for (auto dtype : {c10::kFloat, c10::kDouble}) {
    tables.push_back(std::make_unique<ps::DenseTable>("w", std::vector<int64_t>{3}, 0, 3, at::zeros({3}, dtype),
                                                      ps::OptimizerConfig::sgd(0.1), 1));
  }
  auto set_learning_rate = [&](uint32_t table, double lr) {
    ps::WireWriter writer;
    ps::encode_learning_rate(writer, table, lr);
    const auto payload = writer.release();
    ps::check_learning_rate(ps::decode_request(ps::MessageKind::SetLearningRate, payload.data(), payload.size()),
                            tables, 0);
  };
  CHECK_NOTHROW(set_learning_rate(0, 0.5));
  CHECK_NOTHROW(set_learning_rate(1, 1e300));
  CHECK_THROWS_WITH(set_learning_rate(0, 1e300), Contains("lr 1e+300 is not in [0, 3.40282e+38] (Float)"));
  CHECK_THROWS_WITH(set_learning_rate(0, -1), Contains("learning rate -1 is negative"));
  CHECK_THROWS_WITH(set_learning_rate(2, 0.1), Contains("unknown table id 2"));
}

// The first touch used to make room for 1024 rows whatever their width: 256 MiB here, 4 GiB (12 with
// Adam's state) for one row at the widest rows a registration allows, from a 235-byte message
// (tests/fuzz/regressions/sparse-wide-row-first-touch).
