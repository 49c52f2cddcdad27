// ps/request_tracker: a worker's requests in flight, their deadlines and its servers' failures
// (in-process, time passed in: no servers, no waiting).
#include "catch_with_torch.h"

#include <torchpar/ps/request_tracker.h>

#include <thread>

namespace ps = torchpar::ps;
using Catch::Matchers::Contains;
using Catch::Matchers::Equals;
using std::chrono::milliseconds;
using Clock = ps::RequestTracker::Clock;

namespace {

ps::RequestTracker two_servers(milliseconds timeout = milliseconds(10000)) {
  return ps::RequestTracker({"parameter server 0 (rank 2)", "parameter server 1 (rank 3)"}, timeout);
}

// Records what happened to each request started through it.
struct Outcomes {
  std::vector<std::string> errors;
  int replies = 0;
  bool start(ps::RequestTracker& tracker, int64_t id, int server, ps::MessageKind kind, const std::string& what,
             Clock::time_point sent) {
    return tracker.start(
        id, server, kind, what, [this](const ps::Message&) { ++replies; },
        [this](const std::string& reason) { errors.push_back(reason); }, sent);
  }
};

} // namespace

TEST_CASE("request tracker: reads may wait a BSP round's timeout and then some, writes the timeout") {
  const milliseconds timeout(10000);
  for (auto kind : {ps::MessageKind::Pull, ps::MessageKind::PushPull, ps::MessageKind::PullRows}) {
    CHECK(ps::RequestTracker::deadline_for(kind, timeout) == milliseconds(15000));
  }
  for (auto kind : {ps::MessageKind::Push, ps::MessageKind::PushRows, ps::MessageKind::Checkpoint}) {
    CHECK(ps::RequestTracker::deadline_for(kind, timeout) == timeout);
  }
  // Never less than 2 s extra, however short the timeout.
  CHECK(ps::RequestTracker::deadline_for(ps::MessageKind::Pull, milliseconds(100)) == milliseconds(2100));
}

TEST_CASE("request tracker: a reply is matched once, a second one for the same request is ignored") {
  auto tracker = two_servers();
  Outcomes outcomes;
  REQUIRE(outcomes.start(tracker, 7, 1, ps::MessageKind::Push, "push of 'w'", Clock::now()));
  CHECK(tracker.in_flight() == 1);
  auto request = tracker.answer(7);
  REQUIRE(request.has_value());
  CHECK(request->server == 1);
  CHECK(request->what == "push of 'w'");
  CHECK_FALSE(tracker.answer(7).has_value());
  CHECK_FALSE(tracker.answer(8).has_value());
  CHECK(tracker.in_flight() == 0);
}

TEST_CASE("request tracker: only requests past their own deadline expire, naming server, request and deadline") {
  auto tracker = two_servers();
  Outcomes outcomes;
  const auto t0 = Clock::now();
  outcomes.start(tracker, 1, 0, ps::MessageKind::Push, "push of 'w'", t0);     // deadline 10 s
  outcomes.start(tracker, 2, 1, ps::MessageKind::Pull, "pull of 'w'", t0);     // deadline 15 s
  outcomes.start(tracker, 3, 1, ps::MessageKind::Push, "push of 'b'", t0 + milliseconds(5000));
  tracker.expire(t0 + milliseconds(10000));
  CHECK(outcomes.errors.empty());  // exactly at the deadline is still in time
  tracker.expire(t0 + milliseconds(12000));
  REQUIRE(outcomes.errors.size() == 1);
  CHECK_THAT(outcomes.errors[0],
             Equals("torchpar.ps: parameter server 0 (rank 2) did not answer push of 'w' within 10000 ms"));
  CHECK_FALSE(tracker.answer(1).has_value());  // its late reply finds nothing to complete
  tracker.expire(t0 + milliseconds(15001));
  REQUIRE(outcomes.errors.size() == 3);
  CHECK_THAT(outcomes.errors[1] + outcomes.errors[2], Contains("pull of 'w' within 15000 ms") &&
                                                         Contains("push of 'b' within 10000 ms"));
}

TEST_CASE("request tracker: an expired read keeps its late-reply handler until the reply, its server's end or finish") {
  auto tracker = two_servers();
  std::vector<std::string> errors;
  std::vector<int64_t> late;
  const auto t0 = Clock::now();
  auto start = [&](int64_t id, int server, bool with_late_handler) {
    ps::RequestTracker::OnReply on_late;
    if (with_late_handler) on_late = [&late, id](const ps::Message&) { late.push_back(id); };
    return tracker.start(
        id, server, ps::MessageKind::Pull, "pull of 'w'", [](const ps::Message&) { FAIL("answered in time"); },
        [&errors](const std::string& reason) { errors.push_back(reason); }, t0, on_late);
  };
  start(1, 0, true);
  start(2, 0, false);  // nothing lent: nothing to do late
  start(3, 1, true);
  start(4, 0, true);
  CHECK_FALSE(tracker.late_reply(1));  // in flight: no late reply yet
  tracker.expire(t0 + milliseconds(15001));
  CHECK(errors.size() == 4);  // the futures fail at the deadline, handlers or not
  CHECK_FALSE(tracker.answer(1).has_value());
  auto handle = tracker.late_reply(1);
  REQUIRE(handle);
  handle(ps::Message{});
  CHECK(late == std::vector<int64_t>{1});
  CHECK_FALSE(tracker.late_reply(1));  // given out once
  CHECK_FALSE(tracker.late_reply(2));
  tracker.server_failed(1, "connection reset by peer");  // its replies never come
  CHECK_FALSE(tracker.late_reply(3));
  REQUIRE(tracker.late_reply(4));
  start(5, 0, true);
  tracker.expire(t0 + milliseconds(15001));
  tracker.fail_all("was not answered before this worker finished");
  CHECK_FALSE(tracker.late_reply(5));
}

TEST_CASE("request tracker: a failed server fails its requests and refuses later ones, the others go on") {
  auto tracker = two_servers();
  Outcomes outcomes;
  outcomes.start(tracker, 1, 0, ps::MessageKind::Push, "push of 'w'", Clock::now());
  outcomes.start(tracker, 2, 1, ps::MessageKind::Push, "push of 'w'", Clock::now());
  CHECK_FALSE(tracker.any_server_failed());
  tracker.server_failed(1, "connection reset by peer");
  CHECK(tracker.any_server_failed());
  REQUIRE(outcomes.errors.size() == 1);
  CHECK_THAT(outcomes.errors[0], Equals("torchpar.ps: parameter server 1 (rank 3) failed during push of 'w': "
                                        "connection reset by peer"));
  CHECK_FALSE(outcomes.start(tracker, 3, 1, ps::MessageKind::Pull, "pull of 'w'", Clock::now()));
  REQUIRE(outcomes.errors.size() == 2);
  CHECK_THAT(outcomes.errors[1], Equals("torchpar.ps: pull of 'w': parameter server 1 (rank 3) failed earlier: "
                                        "connection reset by peer"));
  CHECK(outcomes.start(tracker, 4, 0, ps::MessageKind::Pull, "pull of 'w'", Clock::now()));
  CHECK(tracker.in_flight() == 2);  // requests 1 and 4 on server 0
}

TEST_CASE("request tracker: after finish, requests are refused and the unanswered fail with the reason") {
  auto tracker = two_servers();
  Outcomes outcomes;
  outcomes.start(tracker, 1, 0, ps::MessageKind::PushRows, "push_rows of 'emb'", Clock::now());
  CHECK(tracker.finish());
  CHECK_FALSE(tracker.finish());  // once
  CHECK_FALSE(outcomes.start(tracker, 2, 0, ps::MessageKind::Pull, "pull of 'w'", Clock::now()));
  CHECK_THAT(outcomes.errors.at(0), Equals("torchpar.ps: pull of 'w' after this worker finished"));
  tracker.fail_all("was not answered before this worker finished");
  CHECK_THAT(outcomes.errors.at(1),
             Equals("torchpar.ps: push_rows of 'emb' was not answered before this worker finished"));
  CHECK(tracker.in_flight() == 0);
}

TEST_CASE("request tracker: waiting for goodbyes ends once every server said goodbye or failed") {
  auto tracker = two_servers();
  std::thread servers([&] {
    tracker.server_said_goodbye(0);
    tracker.server_failed(1, "gone");
  });
  const auto began = Clock::now();
  tracker.wait_for_goodbyes(milliseconds(60000));
  servers.join();
  CHECK(Clock::now() - began < milliseconds(30000));  // it did not wait out its timeout
}
