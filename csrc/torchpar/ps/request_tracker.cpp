#include <torchpar/ps/request_tracker.h>

#include <algorithm>

namespace torchpar::ps {

RequestTracker::RequestTracker(std::vector<std::string> server_names, std::chrono::milliseconds timeout)
    : server_names_(std::move(server_names)),
      timeout_(timeout),
      server_failures_(server_names_.size()),
      said_goodbye_(server_names_.size(), false) {}

std::chrono::milliseconds RequestTracker::deadline_for(MessageKind kind, std::chrono::milliseconds timeout) {
  const bool reads = kind == MessageKind::Pull || kind == MessageKind::PushPull || kind == MessageKind::PullRows;
  return reads ? timeout + std::max(timeout / 2, std::chrono::milliseconds(2000)) : timeout;
}

bool RequestTracker::start(int64_t id, int server, MessageKind kind, std::string what, OnReply on_reply,
                           OnError on_error, Clock::time_point now, OnReply on_late_reply) {
  std::string refusal;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_) {
      refusal = "torchpar.ps: " + what + " after this worker finished";
    } else if (!server_failures_.at(server).empty()) {
      refusal = "torchpar.ps: " + what + ": " + server_names_[server] + " failed earlier: " + server_failures_[server];
    } else {
      requests_.emplace(id, Request{server, std::move(what), now, deadline_for(kind, timeout_), std::move(on_reply),
                                    std::move(on_error), std::move(on_late_reply)});
      return true;
    }
  }
  on_error(refusal);
  return false;
}

std::optional<RequestTracker::Request> RequestTracker::answer(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = requests_.find(id);
  if (it == requests_.end()) {
    return std::nullopt;
  }
  auto request = std::move(it->second);
  requests_.erase(it);
  return request;
}

RequestTracker::OnReply RequestTracker::late_reply(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = late_replies_.find(id);
  if (it == late_replies_.end()) {
    return {};
  }
  auto handle = std::move(it->second.handle);
  late_replies_.erase(it);
  return handle;
}

void RequestTracker::forget_late_replies(int server) {
  std::erase_if(late_replies_, [server](const auto& entry) { return server < 0 || entry.second.server == server; });
}

std::vector<RequestTracker::Request> RequestTracker::take(const std::function<bool(const Request&)>& which) {
  std::vector<Request> taken;
  for (auto it = requests_.begin(); it != requests_.end();) {
    if (which(it->second)) {
      taken.push_back(std::move(it->second));
      it = requests_.erase(it);
    } else {
      ++it;
    }
  }
  return taken;
}

void RequestTracker::server_failed(int server, const std::string& reason) {
  std::vector<Request> failed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    server_failures_.at(server) = reason;
    failed = take([server](const Request& request) { return request.server == server; });
    forget_late_replies(server);
  }
  goodbye_or_failure_.notify_all();
  for (auto& request : failed) {
    request.on_error("torchpar.ps: " + server_names_[server] + " failed during " + request.what + ": " + reason);
  }
}

void RequestTracker::server_said_goodbye(int server) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    said_goodbye_.at(server) = true;
    forget_late_replies(server);
  }
  goodbye_or_failure_.notify_all();
}

void RequestTracker::expire(Clock::time_point now) {
  std::vector<Request> expired;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = requests_.begin(); it != requests_.end();) {
      if (now - it->second.sent > it->second.deadline) {
        if (it->second.on_late_reply) late_replies_.emplace(it->first, LateReply{it->second.server, it->second.on_late_reply});
        expired.push_back(std::move(it->second));
        it = requests_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& request : expired) {
    request.on_error("torchpar.ps: " + server_names_[request.server] + " did not answer " + request.what +
                     " within " + std::to_string(request.deadline.count()) + " ms");
  }
}

bool RequestTracker::finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  const bool was_finished = finished_;
  finished_ = true;
  return !was_finished;
}

bool RequestTracker::any_server_failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::any_of(server_failures_.begin(), server_failures_.end(),
                     [](const std::string& failure) { return !failure.empty(); });
}

void RequestTracker::wait_for_goodbyes(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  goodbye_or_failure_.wait_for(lock, timeout, [&] {
    for (size_t s = 0; s < server_names_.size(); ++s) {
      if (!said_goodbye_[s] && server_failures_[s].empty()) return false;
    }
    return true;
  });
}

void RequestTracker::fail_all(const std::string& reason) {
  std::vector<Request> unanswered;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    unanswered = take([](const Request&) { return true; });
    forget_late_replies(-1);
  }
  for (auto& request : unanswered) {
    request.on_error("torchpar.ps: " + request.what + " " + reason);
  }
}

size_t RequestTracker::in_flight() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return requests_.size();
}

} // namespace torchpar::ps
