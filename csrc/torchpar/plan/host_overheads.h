// What the engines cost on these ranks beyond compute and idle-network transfers, measured before any --verify,
// for LibTorch programs (Python's planner measures its own engines: python/torchpar/plan/host_overhead.py).
//
// DDP's all-reduces, run while the ranks compute, cost more than the probes of an idle process group said, and a
// pipeline's actions cost host work (posting transfers, the schedule's bookkeeping, waking the rank that waits):
// without them the cost model predicted the C++ pipeline example 50% fast. So a DDP and a pipeline of small
// layers run for real on the ranks at hand, and the calibration takes the values under which the cost model
// reproduces their steps.
#pragma once
#include <torchpar/common/c10d_fwd.h>
#include <torchpar/plan/cost_model.h>

#include <vector>

namespace torchpar::plan {

// Every rank of `group` calls it; rank 0's calibration gets the answers (the others' stays as it was), and the
// default CPU generator's state is as it was before. Sets, in this order (each fitted with those before it),
// `calibration.communication_scale` from DDP of four Linear(512, 512) at 16 samples a rank, and `per_action_ms`
// from a 1F1B pipeline of one Linear(8, 8) per rank with 4 micro-batches. Returns those runs as calibration
// samples (rank 0), for verify_plan_on_ranks's fit. Nothing on a group of one rank.
std::vector<CalibrationSample> measure_host_overheads(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                      const NetworkProfile& network, Calibration& calibration);

} // namespace torchpar::plan
