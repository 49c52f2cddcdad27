#include <torchpar/ddp/timeline.h>

#include <c10/util/Exception.h>
#include <c10/util/env.h>

#include <algorithm>
#include <atomic>
#include <sstream>

namespace torchpar::ddp {
namespace {

int64_t micros(Timeline::Clock::time_point time) {
  return std::chrono::duration_cast<std::chrono::microseconds>(time.time_since_epoch()).count();
}

// The first DDP instance of a process writes trace.rank<r>.json, later ones trace.rank<r>.<n>.json.
std::string rank_path(const std::string& path, int rank) {
  static std::atomic<int> instances{0};
  const int instance = instances++;
  const auto slash = path.find_last_of('/');
  const auto dot = path.find_last_of('.');
  const std::string suffix = ".rank" + std::to_string(rank) + (instance ? "." + std::to_string(instance) : "");
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) {
    return path + suffix;
  }
  return path.substr(0, dot) + suffix + path.substr(dot);
}

} // namespace

std::shared_ptr<Timeline> Timeline::from_environment(int rank) {
  const auto path = c10::utils::get_env("TORCHPAR_TIMELINE");
  if (!path || path->empty()) {
    return nullptr;
  }
  return std::make_shared<Timeline>(rank_path(*path, rank), rank);
}

Timeline::Timeline(const std::string& path, int rank) : path_(path), rank_(rank), out_(path) {
  TORCH_CHECK(out_.good(), "TORCHPAR_TIMELINE: cannot write the timeline file ", path_);
  // An unterminated JSON array is valid Chrome-trace input, so a crashed rank's trace still loads.
  out_ << "[\n";
  std::ostringstream process_name;
  process_name << "\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << rank_
               << ",\"args\":{\"name\":\"rank " << rank_ << "\"}";
  write_event(process_name.str());
}

Timeline::~Timeline() {
  std::lock_guard<std::mutex> lock(mutex_);
  out_ << "\n]\n";
}

int Timeline::track_id(const std::string& track) {
  const auto found = std::find(tracks_.begin(), tracks_.end(), track);
  if (found != tracks_.end()) {
    return static_cast<int>(found - tracks_.begin());
  }
  tracks_.push_back(track);
  const int id = static_cast<int>(tracks_.size() - 1);
  std::ostringstream thread_name;
  thread_name << "\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << rank_ << ",\"tid\":" << id
              << ",\"args\":{\"name\":\"" << track << "\"}";
  write_event(thread_name.str());
  return id;
}

void Timeline::span(const std::string& name, const std::string& track, Clock::time_point begin) {
  const auto end = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  std::ostringstream event;
  event << "\"name\":\"" << name << "\",\"ph\":\"X\",\"pid\":" << rank_ << ",\"tid\":" << track_id(track)
        << ",\"ts\":" << micros(begin) << ",\"dur\":" << std::max<int64_t>(micros(end) - micros(begin), 0);
  write_event(event.str());
}

void Timeline::instant(const std::string& name, const std::string& track) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  std::ostringstream event;
  event << "\"name\":\"" << name << "\",\"ph\":\"i\",\"s\":\"t\",\"pid\":" << rank_
        << ",\"tid\":" << track_id(track) << ",\"ts\":" << micros(now);
  write_event(event.str());
}

void Timeline::write_event(const std::string& json_fields) {
  out_ << (first_event_ ? "" : ",\n") << '{' << json_fields << '}';
  first_event_ = false;
  out_.flush();
}

} // namespace torchpar::ddp
