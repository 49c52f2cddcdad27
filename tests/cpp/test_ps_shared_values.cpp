// ps/shared_values: a server's values lent in place to same-host readers, both sides in this process
// (the reader maps the region through /proc/self's descriptor, as a worker on the host would), and a
// reader in a forked process that dies or stops holding them.
#include "catch_with_torch.h"

#include <torchpar/ps/shared_values.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <utility>
#include <vector>

namespace ps = torchpar::ps;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

namespace {

constexpr int64_t kNumel = 1000;

struct Revocations {
  std::vector<std::pair<int, std::string>> seen;
  ps::SharedValues::OnRevoked record() {
    return [this](int worker, const std::string& why) { seen.emplace_back(worker, why); };
  }
};

std::unique_ptr<ps::MappedValues> map_or_fail(const ps::SharedValues& values, int worker) {
  std::string why_not;
  auto mapped = ps::MappedValues::open(values.offer(), worker, &why_not);
  INFO(why_not);
  REQUIRE(mapped);
  return mapped;
}

// A forked process that maps `values` as reader 1, then does `then` (exits, stops itself).
pid_t reader_in_a_child(const ps::SharedValues& values, void (*then)()) {
  const pid_t child = ::fork();
  if (child == 0) {
    std::string why_not;
    if (!ps::MappedValues::open(values.offer(), 1, &why_not)) ::_exit(1);
    then();
    ::_exit(0);
  }
  REQUIRE(child >= 0);
  return child;
}

// Lends the values to reader 1 and waits until the server may change them again: how long that took.
std::chrono::steady_clock::duration lend_to_the_child_and_take_back(ps::SharedValues& values) {
  REQUIRE(values.lend(1) != 0);
  const auto started = std::chrono::steady_clock::now();
  values.wait_until_returned();
  return std::chrono::steady_clock::now() - started;
}

void check_the_child_lost_it(const Revocations& revocations, const std::string& because) {
  REQUIRE(revocations.seen.size() == 1);
  CHECK(revocations.seen[0].first == 1);
  CHECK_THAT(revocations.seen[0].second, Contains(because));
}

} // namespace

TEST_CASE("ps shared values: a lent read copies the values and hands them back, and changes wait for that") {
  Revocations revocations;
  ps::SharedValues values(kNumel, at::kFloat, 2, 10s, revocations.record());
  values.values().copy_(at::arange(kNumel, at::kFloat));
  auto reader = map_or_fail(values, 1);

  const uint64_t lending = values.lend(1);
  REQUIRE(lending != 0);
  CHECK(values.lend(1) == 0);  // still held: a second read of it is answered with a copy

  std::atomic<bool> returned{false};
  std::thread server([&] {
    values.wait_until_returned();
    returned = true;
  });
  std::this_thread::sleep_for(50ms);
  CHECK_FALSE(returned);  // the reader has not handed them back yet

  auto out = at::empty({kNumel}, at::kFloat);
  reader->read(lending, out.nbytes(), out.data_ptr());
  server.join();
  CHECK(returned);
  CHECK(at::equal(out, at::arange(kNumel, at::kFloat)));
  CHECK(revocations.seen.empty());

  const uint64_t next = values.lend(1);
  CHECK(next > lending);
  CHECK_THROWS_WITH(reader->read(lending, out.nbytes(), out.data_ptr()), Contains("took back"));  // a stale one
  reader->hand_back_any();
  values.wait_until_returned();  // at once: nothing is lent
}

TEST_CASE("ps shared values: a reader that holds the values past the timeout loses them, and its read fails") {
  Revocations revocations;
  ps::SharedValues values(kNumel, at::kFloat, 1, 50ms, revocations.record());
  auto reader = map_or_fail(values, 0);
  const uint64_t lending = values.lend(0);
  const auto started = std::chrono::steady_clock::now();
  values.wait_until_returned();
  CHECK(std::chrono::steady_clock::now() - started >= 50ms);
  REQUIRE(revocations.seen.size() == 1);
  CHECK(revocations.seen[0].first == 0);
  CHECK_THAT(revocations.seen[0].second, Contains("within the timeout"));
  auto out = at::empty({kNumel}, at::kFloat);
  CHECK_THROWS_WITH(reader->read(lending, out.nbytes(), out.data_ptr()), Contains("took back"));
}

TEST_CASE("ps shared values: values taken back while the reader copies them fail that read") {
  // Large enough that the copy lasts far longer than the timeout, so the server takes the values back
  // while it runs; the read must then fail, not return what may be half old and half new.
  constexpr int64_t kLarge = int64_t{32} << 20;  // 128 MiB of floats
  Revocations revocations;
  ps::SharedValues values(kLarge, at::kFloat, 1, 1ms, revocations.record());
  auto reader = map_or_fail(values, 0);
  auto out = at::empty({kLarge}, at::kFloat);
  const uint64_t lending = values.lend(0);
  std::atomic<bool> reading{false};
  std::string failure;
  std::thread worker([&] {
    reading = true;
    try {
      reader->read(lending, out.nbytes(), out.data_ptr());
    } catch (const std::exception& error) {
      failure = error.what();
    }
  });
  while (!reading) std::this_thread::yield();
  values.wait_until_returned();  // revokes 1 ms in, the copy still running; an update could follow
  worker.join();
  if (revocations.seen.empty()) {
    // Only if this thread was held off the core until the copy was over.
    CHECK(failure.empty());
  } else {
    CHECK_THAT(revocations.seen[0].second, Contains("within the timeout"));
    CHECK_THAT(failure, Contains("took back the values it lent for this read"));
  }
}

TEST_CASE("ps shared values: a reader whose process died loses its lending at once") {
  Revocations revocations;
  ps::SharedValues values(kNumel, at::kFloat, 2, 60s, revocations.record());
  const pid_t child = reader_in_a_child(values, [] { ::_exit(0); });
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  CHECK(lend_to_the_child_and_take_back(values) < 10s);  // not the 60 s timeout
  check_the_child_lost_it(revocations, "exited");
}

TEST_CASE("ps shared values: a reader whose process is stopped loses its lending after half a second") {
  Revocations revocations;
  ps::SharedValues values(kNumel, at::kFloat, 2, 60s, revocations.record());
  const pid_t child = reader_in_a_child(values, [] { ::raise(SIGSTOP); });  // as a debugger or a frozen job would
  int status = 0;
  REQUIRE(::waitpid(child, &status, WUNTRACED) == child);
  REQUIRE(WIFSTOPPED(status));
  const auto waited = lend_to_the_child_and_take_back(values);
  ::kill(child, SIGKILL);
  ::waitpid(child, &status, 0);
  CHECK(waited >= 400ms);  // the grace: a stop of a moment (a debugger's step) keeps the lending
  CHECK(waited < 10s);     // not the 60 s timeout
  check_the_child_lost_it(revocations, "stopped");
}

TEST_CASE("ps shared values: a reader on another host, or past the server's slots, is declined") {
  Revocations revocations;
  ps::SharedValues values(kNumel, at::kFloat, 2, 1s, revocations.record());
  std::string why_not;
  auto elsewhere = values.offer();
  elsewhere.host = "another-machine/" + elsewhere.host;
  CHECK_FALSE(ps::MappedValues::open(elsewhere, 0, &why_not));
  CHECK_THAT(why_not, Contains("another host"));
  CHECK_FALSE(ps::MappedValues::open(values.offer(), 2, &why_not));
  CHECK_THAT(why_not, Contains("reader slots"));
  auto wrong_token = values.offer();
  wrong_token.token ^= 1;
  CHECK_FALSE(ps::MappedValues::open(wrong_token, 0, &why_not));
  CHECK_THAT(why_not, Contains("is not the peer's table values"));
}

TEST_CASE("ps shared values: a lending handed back unread or taken back by the server frees the values at once") {
  Revocations revocations;
  ps::SharedValues values(kNumel, at::kFloat, 1, 60s, revocations.record());
  auto reader = map_or_fail(values, 0);
  auto out = at::empty({kNumel}, at::kFloat);

  reader->hand_back(values.lend(0));  // a reply that failed before reaching these values
  values.wait_until_returned();       // at once, not after the 60 s timeout

  const uint64_t lending = values.lend(0);
  values.revoke(0);  // the reply did not go out, or the worker was dropped
  values.wait_until_returned();
  CHECK_THROWS_WITH(reader->read(lending, out.nbytes(), out.data_ptr()), Contains("took back"));
  CHECK(revocations.seen.empty());  // taken back on purpose, not for a late or dead reader

  values.lend(0);
  reader->hand_back_any();  // a late reply's, whose lendings are not known
  CHECK(values.lend(0) != 0);
}

TEST_CASE("ps shared values: the timeout bounds the wait for all late readers together, not each") {
  Revocations revocations;
  ps::SharedValues values(kNumel, at::kFloat, 3, 1s, revocations.record());
  std::vector<std::unique_ptr<ps::MappedValues>> readers;
  for (int w = 0; w < 3; ++w) {
    readers.push_back(map_or_fail(values, w));
    REQUIRE(values.lend(w) != 0);
  }
  const auto started = std::chrono::steady_clock::now();
  values.wait_until_returned();
  CHECK(std::chrono::steady_clock::now() - started < 2900ms);  // one timeout (plus slack), not three
  CHECK(revocations.seen.size() == 3);
}
