#include "catch_with_torch.h"
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torchpar/comm/backend_factory.h>

using torchpar::comm::check_backends_usable;
using torchpar::comm::make_backend;
using torchpar::comm::parse_backend_spec;
using Catch::Matchers::Contains;

TEST_CASE("backend strings follow torch.distributed", "[backend]") {
  auto gloo = parse_backend_spec("gloo");
  REQUIRE(gloo.size() == 2);
  CHECK(gloo[0].device == c10::DeviceType::CPU);
  CHECK(gloo[1].device == c10::DeviceType::CUDA);
  CHECK(gloo[1].name == "gloo");

  auto nccl = parse_backend_spec("nccl");
  REQUIRE(nccl.size() == 1);
  CHECK(nccl[0].device == c10::DeviceType::CUDA);

  auto mixed = parse_backend_spec("cpu:gloo,cuda:nccl");
  REQUIRE(mixed.size() == 2);
  CHECK(mixed[0].device == c10::DeviceType::CPU);
  CHECK(mixed[0].name == "gloo");
  CHECK(mixed[1].device == c10::DeviceType::CUDA);
  CHECK(mixed[1].name == "nccl");
}

TEST_CASE("a wrong backend string says what is accepted", "[backend]") {
  CHECK_THROWS_WITH(parse_backend_spec("mpi"), Contains("unknown backend 'mpi'") && Contains("'gloo', 'nccl'"));
  CHECK_THROWS_WITH(parse_backend_spec("tpu:gloo"), Contains("unknown device 'tpu'"));
  CHECK_THROWS_WITH(parse_backend_spec("cpu:gloo,cpu:gloo"), Contains("names a device twice"));
  CHECK_THROWS_WITH(parse_backend_spec("cpu:gloo,nccl"), Contains("is not device:backend"));
}

TEST_CASE("nccl without a GPU for this rank is refused before connecting", "[backend]") {
  if (at::globalContext().hasCUDA()) {
    CHECK_THROWS_WITH(check_backends_usable(parse_backend_spec("nccl"), 0, 4096), Contains("LOCAL_RANK=4096"));
  } else {
    CHECK_THROWS_WITH(
        check_backends_usable(parse_backend_spec("nccl"), 0, 0),
        Contains("backend 'nccl'") && Contains("use backend 'gloo'"));
  }
  CHECK_NOTHROW(check_backends_usable(parse_backend_spec("gloo"), 0, 0));
}

TEST_CASE("a backend instance of an unknown name is refused, naming the known ones", "[backend]") {
  CHECK_THROWS_WITH(make_backend("mpi", c10::make_intrusive<c10d::HashStore>(), 0, 1, 0, std::chrono::seconds(1)),
                    Contains("unknown backend 'mpi'") && Contains("'gloo', 'nccl' or 'shm'"));
}
