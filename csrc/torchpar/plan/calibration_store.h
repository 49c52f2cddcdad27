// What --verify teaches the cost model, kept per machine: every verified configuration (the profile and network
// measurements its prediction came from, and its measured step time) is a sample; the calibration is
// fit_calibration over the samples of one torch version, backend, world size and thread count, across runs and
// models, so that one noisy run does not decide it. C++ programs (plan_on_ranks) and `python -m torchpar.plan`
// read and write the same store.
//
//   plan::CalibrationStore store;                          // calibration_file()
//   auto learned = store.calibration(4, "gloo");           // empty before any --verify on this machine
//   auto refit = store.learn(new_samples, 4, "gloo", plan::default_calibration(4));
//
// The file is torch's pickle format (torch.load(path, weights_only=False) reads it):
// {key: {"calibration": {knob: value}, "samples": [sample fields]}}, written whole through a temporary file, so a
// crash leaves the previous one.
#pragma once
#include <torchpar/plan/cost_model.h>

#include <optional>
#include <string>
#include <vector>

namespace torchpar::plan {

// $TORCHPAR_PLAN_CALIBRATION, else $XDG_CACHE_HOME/torchpar/plan_calibration.pt, else
// ~/.cache/torchpar/plan_calibration.pt.
std::string calibration_file();

// Before any --verify: gradient communication hidden behind backward only when every rank has a core to spare
// for its communication thread (2 x world cores; in between, in proportion). The engines' host times stay at
// zero (Python's plan measures them on the ranks at hand: host_overhead.py).
Calibration default_calibration(int world);

// "compute x 1.20, communication x 1.00, 50% of communication overlapped, ..." (every knob).
std::string describe(const Calibration& calibration);

struct LearnedCalibration {
  Calibration calibration;
  int samples = 0;  // how many samples it rests on
};

class CalibrationStore {
 public:
  static constexpr int kKeptSamples = 60;  // the most recent per key: the machine may change under it

  explicit CalibrationStore(std::string path = calibration_file());
  const std::string& path() const { return path_; }

  // What earlier runs taught for this world and backend on this torch and thread count, if anything. Throws,
  // naming the file, where it is there but is not a calibration store.
  std::optional<Calibration> calibration(int world, const std::string& backend) const;
  // The samples kept for them, oldest first (those written by a version whose fields no longer parse are left out).
  std::vector<CalibrationSample> samples(int world, const std::string& backend) const;
  // Adds `samples` to those kept, fits the calibration to all of them from `start`, keeps both.
  LearnedCalibration learn(const std::vector<CalibrationSample>& samples, int world, const std::string& backend,
                           const Calibration& start);

 private:
  std::string path_;
};

// The key samples are kept under: "torch 2.15.0/gloo/4 ranks/1 threads/v3".
std::string calibration_key(int world, const std::string& backend);

} // namespace torchpar::plan
