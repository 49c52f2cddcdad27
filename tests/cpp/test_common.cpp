// torchpar/common/ alone, in-process: the helpers comm/ and every strategy share.
#include "catch_with_torch.h"
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <stdexcept>
#include <string>
#include <thread>

#include <torchpar/common/cpu_allocations.h>
#include <torchpar/common/error_message.h>
#include <torchpar/common/flat_buffers.h>
#include <torchpar/common/hash.h>

TEST_CASE("flatten copies tensors of any shape into one buffer, in order", "[common]") {
  const auto matrix = at::arange(6, at::kFloat).view({2, 3});
  const auto transposed = at::arange(6, 10, at::kFloat).view({2, 2}).t();
  const auto flat = torchpar::flatten({matrix, transposed});
  REQUIRE(flat.sizes() == c10::IntArrayRef{10});
  CHECK(at::equal(flat, at::tensor({0, 1, 2, 3, 4, 5, 6, 8, 7, 9}, at::kFloat)));
}

TEST_CASE("flatten of a single tensor is a copy, not a view", "[common]") {
  const auto tensor = at::arange(4, at::kFloat);
  auto flat = torchpar::flatten({tensor});
  flat.add_(1);
  CHECK(at::equal(tensor, at::arange(4, at::kFloat)));
}

TEST_CASE("unflatten_into writes each slice back into its own tensor's shape", "[common]") {
  const auto matrix = at::zeros({2, 3}, at::kFloat);
  const auto empty = at::zeros({0, 3}, at::kFloat);
  const auto vector = at::zeros({2}, at::kFloat);
  torchpar::unflatten_into(at::arange(8, at::kFloat), {matrix, empty, vector});
  CHECK(at::equal(matrix, at::arange(6, at::kFloat).view({2, 3})));
  CHECK(at::equal(vector, at::tensor({6, 7}, at::kFloat)));
}

TEST_CASE("unflatten_into after flatten restores the tensors", "[common]") {
  const auto first = at::arange(6, at::kDouble).view({3, 2});
  const auto second = at::arange(3, at::kDouble);
  const auto flat = torchpar::flatten({first, second}).mul_(2);
  torchpar::unflatten_into(flat, {first, second});
  CHECK(at::equal(first, at::arange(0, 12, 2, at::kDouble).view({3, 2})));
  CHECK(at::equal(second, at::arange(0, 6, 2, at::kDouble)));
}

TEST_CASE("splitmix64 keeps its exact bits", "[common]") {
  // 0 gives splitmix64's published first output; rows' servers and initial values depend on all three.
  CHECK(torchpar::splitmix64(0) == 0xe220a8397b1dcdafULL);
  CHECK(torchpar::splitmix64(1) == 0x910a2dec89025cc1ULL);
  CHECK(torchpar::splitmix64(12345) == 0x22118258a9d111a0ULL);
}

TEST_CASE("message_of gives what an exception says, without c10's backtrace", "[common]") {
  std::string c10_message;
  try {
    TORCH_CHECK(false, "shape [2, 3] on rank 1");
  } catch (const std::exception& error) {
    c10_message = torchpar::message_of(error);
  }
  CHECK(c10_message == "shape [2, 3] on rank 1");
  CHECK(torchpar::message_of(std::runtime_error("store timed out")) == "store timed out");
}

TEST_CASE("CPU allocations are counted to the byte once counting is on and on every thread", "[common]") {
  auto before = at::empty({1000});  // allocated before counting: neither it nor its release counts
  torchpar::count_cpu_allocations();
  torchpar::count_cpu_allocations();  // idempotent
  REQUIRE(torchpar::counting_cpu_allocations());
  const int64_t start = torchpar::cpu_allocations().current;
  torchpar::reset_cpu_allocation_peak();
  {
    auto four_mib = at::empty({1 << 20});
    at::Tensor other_thread;
    std::thread([&] { other_thread = at::empty({256}, at::kDouble); }).join();
    CHECK(torchpar::cpu_allocations().current - start == (4 << 20) + 2048);
    before.reset();
  }
  CHECK(torchpar::cpu_allocations().current == start);
  CHECK(torchpar::cpu_allocations().peak - start == (4 << 20) + 2048);
  torchpar::reset_cpu_allocation_peak();
  CHECK(torchpar::cpu_allocations().peak == start);
}
