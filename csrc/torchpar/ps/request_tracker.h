// A worker's requests in flight to the parameter servers: their deadlines, the servers that failed or
// said goodbye, and whether the worker finished. Bookkeeping only (no channels, no threads: the
// client's caller, receiver and watchdog threads call in, time passed as an argument), so the rules
// are tested alone. Callbacks run outside the lock.
#pragma once
#include <torchpar/ps/channel.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace torchpar::ps {

class RequestTracker {
 public:
  using Clock = std::chrono::steady_clock;
  using OnReply = std::function<void(const Message&)>;
  using OnError = std::function<void(const std::string&)>;

  struct Request {
    int server = 0;
    std::string what; // "push of 'w', 'b'": how errors name it
    Clock::time_point sent;
    std::chrono::milliseconds deadline{0};
    OnReply on_reply;
    OnError on_error;
    // For a reply that arrives after the request failed past its deadline (may be empty): a read hands
    // back, unread, the values the server lent it.
    OnReply on_late_reply;
  };

  // server_names: how errors name each server, e.g. "parameter server 0 (rank 3)".
  RequestTracker(std::vector<std::string> server_names, std::chrono::milliseconds timeout);

  // How long a request of `kind` may stay unanswered. A read may wait for a BSP round, which the
  // server closes (dropping the late worker) only after the timeout: reads get the time to see that.
  static std::chrono::milliseconds deadline_for(MessageKind kind, std::chrono::milliseconds timeout);

  // Tracks request `id`; false (after calling on_error with the reason) when it must not be sent:
  // the worker finished, or the server failed earlier.
  bool start(int64_t id, int server, MessageKind kind, std::string what, OnReply on_reply, OnError on_error,
             Clock::time_point now, OnReply on_late_reply = {});
  // The request a reply answers; none when it is not tracked (it already failed, e.g. past its deadline).
  std::optional<Request> answer(int64_t id);
  // The late-reply handler of request `id`, which expired with one; empty otherwise. Given out once; kept
  // until then, or until its server fails or says goodbye, or every request fails.
  OnReply late_reply(int64_t id);
  // The connection to `server` broke: its requests fail, and later ones are refused.
  void server_failed(int server, const std::string& reason);
  // The server acknowledged this worker's finish.
  void server_said_goodbye(int server);
  // Fails the requests older than their deadlines at `now` (keeping their late-reply handlers).
  void expire(Clock::time_point now);

  // Marks the worker finished (later requests are refused); false if it already was.
  bool finish();
  bool any_server_failed() const;
  // Waits up to `timeout` until every server said goodbye or failed.
  void wait_for_goodbyes(std::chrono::milliseconds timeout);
  // Fails every request still tracked: "<what> <reason>".
  void fail_all(const std::string& reason);

  size_t in_flight() const;
  const std::string& server_name(int server) const { return server_names_.at(server); }

 private:
  // Removes the requests `which` selects; the caller holds mutex_.
  std::vector<Request> take(const std::function<bool(const Request&)>& which);
  // Drops the late-reply handlers of `server`'s requests (all servers' when negative); the caller holds mutex_.
  void forget_late_replies(int server);

  const std::vector<std::string> server_names_;
  const std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;
  std::map<int64_t, Request> requests_;
  struct LateReply {
    int server;
    OnReply handle;
  };
  std::map<int64_t, LateReply> late_replies_;
  std::vector<std::string> server_failures_; // non-empty: that server is gone
  std::vector<bool> said_goodbye_;
  bool finished_ = false;
  std::condition_variable goodbye_or_failure_;
};

} // namespace torchpar::ps
