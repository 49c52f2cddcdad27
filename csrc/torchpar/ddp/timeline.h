// A Chrome-trace (chrome://tracing, Perfetto) record of one rank's training steps, Horovod-style:
// forward and backward spans, the moment each gradient bucket is ready, and each bucket's
// all-reduce span, so overlap of communication with backward can be seen.
#pragma once
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace torchpar::ddp {

class Timeline {
 public:
  using Clock = std::chrono::system_clock;  // one clock for all ranks of a host: traces line up

  // With TORCHPAR_TIMELINE=<path>, rank r writes <path> with ".rank<r>" inserted before its
  // extension (trace.json -> trace.rank0.json; a second DDP instance in the process: trace.rank0.1.json);
  // otherwise returns null (no tracing).
  static std::shared_ptr<Timeline> from_environment(int rank);

  Timeline(const std::string& path, int rank);
  ~Timeline();

  // A finished span [begin, now) on the named track.
  void span(const std::string& name, const std::string& track, Clock::time_point begin);
  void instant(const std::string& name, const std::string& track);

  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& json_fields);
  int track_id(const std::string& track);

  std::string path_;
  int rank_;
  std::mutex mutex_;
  std::ofstream out_;
  bool first_event_ = true;
  std::vector<std::string> tracks_;
};

} // namespace torchpar::ddp
