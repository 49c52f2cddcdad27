// Runs every rank's action list without communication or tensors: checks that the lists form a
// complete, deadlock-free pipeline step and predicts its timeline, bubble and activation memory.
#pragma once
#include <torchpar/pipeline/action.h>
#include <torchpar/pipeline/schedules.h>

#include <map>
#include <string>
#include <vector>

namespace torchpar::pipeline {

// Durations. The defaults are the usual assumption of the schedule papers: a backward costs two
// forwards, split evenly into input and weight gradients, and communication is free. `transfer` is
// the delay from a send to its data being usable on the receiving rank (measured, it makes the
// prediction of a real run's bubble honest).
struct ActionCosts {
  double forward = 1.0;
  double backward = 2.0;
  double backward_input = 1.0;
  double backward_weight = 1.0;
  double transfer = 0.0;
};

// Costs given by name, one map per stage, as Python passes them to simulate_stages: the keys are
// ActionCosts' fields ("forward", "backward", "backward_input", "backward_weight", "transfer"), and
// a field a map leaves out keeps its default. Throws on any other key, listing the fields.
std::vector<ActionCosts> parse_stage_costs(const std::vector<std::map<std::string, double>>& stage_costs);

struct TimedAction {
  Action action;
  double start = 0;
  double end = 0;
};

struct Simulation {
  int ranks = 0;
  int stages = 0;
  int microbatches = 0;
  std::vector<std::vector<TimedAction>> timeline;  // per rank, compute actions in execution order
  double makespan = 0;
  double bubble_fraction = 0;            // idle share of ranks x makespan
  std::vector<int> peak_activations;     // per rank: most (stage, micro-batch) activations alive at once
};

// Throws a c10::Error describing the first problem: an action on the wrong rank, a forward without
// its backward (or an I without its W), a send without its receive, or a deadlock (naming what each
// blocked rank waits for).
Simulation simulate(const std::vector<std::vector<Action>>& rank_actions, int stages, int microbatches,
                    const ActionCosts& costs = {});
Simulation simulate(const ScheduleSpec& spec, const ActionCosts& costs = {});
// Stages of unequal cost: `stage_costs[s]` for the actions of stage s (one entry per stage).
Simulation simulate(const ScheduleSpec& spec, const std::vector<ActionCosts>& stage_costs);

// One row per rank, one column per time unit (the smallest action cost): "F3", "B3", "I3", "W3";
// with virtual stages the stage follows, e.g. "F3s5"; "." is idle.
std::string render_grid(const Simulation& simulation);

} // namespace torchpar::pipeline
