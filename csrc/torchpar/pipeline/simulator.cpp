#include <torchpar/pipeline/simulator.h>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>
#include <utility>

namespace torchpar::pipeline {
namespace {

using Key = std::tuple<ActionType, int, int>;  // (type, stage, micro-batch)

Key key_of(const Action& action) { return {action.type, action.stage, action.microbatch}; }

double cost_of(ActionType type, const ActionCosts& costs) {
  switch (type) {
    case ActionType::Forward: return costs.forward;
    case ActionType::Backward: return costs.backward;
    case ActionType::BackwardInput: return costs.backward_input;
    case ActionType::BackwardWeight: return costs.backward_weight;
    default: return 0.0;
  }
}

class Simulator {
 public:
  Simulator(const std::vector<std::vector<Action>>& lists, int stages, int microbatches,
            std::vector<ActionCosts> stage_costs)
      : lists_(lists), ranks_(static_cast<int>(lists.size())), stages_(stages), microbatches_(microbatches),
        costs_(std::move(stage_costs)) {
    TORCH_CHECK(costs_.size() == static_cast<size_t>(stages), "pipeline simulator: ", costs_.size(),
                " stage costs for ", stages, " stages");
  }

  Simulation run() {
    check_placement_and_completeness();
    Simulation result;
    result.ranks = ranks_;
    result.stages = stages_;
    result.microbatches = microbatches_;
    result.timeline.resize(ranks_);
    result.peak_activations.assign(ranks_, 0);
    std::vector<size_t> next(ranks_, 0);
    std::vector<double> clock(ranks_, 0.0);
    std::vector<int> alive(ranks_, 0);
    std::vector<std::map<Key, bool>> posted(ranks_);

    for (bool progress = true; progress;) {
      progress = false;
      for (int rank = 0; rank < ranks_; ++rank) {
        while (next[rank] < lists_[rank].size()) {
          const Action& action = lists_[rank][next[rank]];
          auto ready = ready_time(action, posted[rank]);
          if (!ready) {
            break;
          }
          const double start = std::max(clock[rank], *ready);
          const double end = start + cost_of(action.type, costs_[action.stage]);
          finished_[key_of(action)] = end;
          if (action.type == ActionType::RecvActivation || action.type == ActionType::RecvGradient) {
            posted[rank][key_of(action)] = true;
          }
          if (is_compute(action.type)) {
            result.timeline[rank].push_back({action, start, end});
            clock[rank] = end;
            alive[rank] += action.type == ActionType::Forward ? 1 : 0;
            alive[rank] -= releases_activations(action) ? 1 : 0;
            result.peak_activations[rank] = std::max(result.peak_activations[rank], alive[rank]);
          }
          ++next[rank];
          progress = true;
        }
      }
    }
    std::ostringstream blocked;
    for (int rank = 0; rank < ranks_; ++rank) {
      if (next[rank] < lists_[rank].size()) {
        blocked << "\n  rank " << rank << " waits at " << to_string(lists_[rank][next[rank]]) << " (action "
                << next[rank] << " of " << lists_[rank].size() << ") for " << waits_for(lists_[rank][next[rank]]);
      }
    }
    TORCH_CHECK(blocked.str().empty(), "pipeline schedule deadlocks:", blocked.str());

    double busy = 0;
    for (int rank = 0; rank < ranks_; ++rank) {
      result.makespan = std::max(result.makespan, clock[rank]);
      for (const auto& timed : result.timeline[rank]) {
        busy += timed.end - timed.start;
      }
    }
    result.bubble_fraction = result.makespan > 0 ? 1.0 - busy / (ranks_ * result.makespan) : 0.0;
    return result;
  }

 private:
  bool releases_activations(const Action& action) const {
    return action.type == ActionType::Backward || action.type == ActionType::BackwardWeight;
  }

  bool remote(int from_stage, int to_stage) const {
    return rank_of_stage(from_stage, ranks_) != rank_of_stage(to_stage, ranks_);
  }

  std::optional<double> done(ActionType type, int stage, int microbatch) const {
    auto found = finished_.find({type, stage, microbatch});
    if (found == finished_.end()) {
      return std::nullopt;
    }
    return found->second;
  }

  // The input gradient of (stage, micro-batch) exists once its B or I finished.
  std::optional<double> input_gradient(int stage, int microbatch) const {
    auto full = done(ActionType::Backward, stage, microbatch);
    return full ? full : done(ActionType::BackwardInput, stage, microbatch);
  }

  // When `action` can start on `rank`, or nothing while a dependency has not run yet.
  std::optional<double> ready_time(const Action& action, const std::map<Key, bool>& posted) const {
    const int s = action.stage, mb = action.microbatch;
    auto arrived = [&](ActionType recv, ActionType send, int sender_stage) -> std::optional<double> {
      if (!posted.count({recv, s, mb})) {
        return std::nullopt;
      }
      auto sent = done(send, sender_stage, mb);
      return sent ? std::optional<double>(*sent + costs_[sender_stage].transfer) : std::nullopt;
    };
    switch (action.type) {
      case ActionType::Forward:
        if (s == 0) {
          return 0.0;
        }
        return remote(s - 1, s) ? arrived(ActionType::RecvActivation, ActionType::SendActivation, s - 1)
                                : done(ActionType::Forward, s - 1, mb);
      case ActionType::Backward:
      case ActionType::BackwardInput: {
        auto own_forward = done(ActionType::Forward, s, mb);
        if (!own_forward) {
          return std::nullopt;
        }
        if (s == stages_ - 1) {
          return own_forward;
        }
        auto gradient = remote(s + 1, s) ? arrived(ActionType::RecvGradient, ActionType::SendGradient, s + 1)
                                         : input_gradient(s + 1, mb);
        if (!gradient) {
          return std::nullopt;
        }
        return std::max(*own_forward, *gradient);
      }
      case ActionType::BackwardWeight:
        return done(ActionType::BackwardInput, s, mb);
      case ActionType::SendActivation:
        return done(ActionType::Forward, s, mb);
      case ActionType::SendGradient:
        return input_gradient(s, mb);
      case ActionType::RecvActivation: {  // guesses its shapes from the previous micro-batch's header
        if (mb == 0) {
          return 0.0;
        }
        auto sent = done(ActionType::SendActivation, s - 1, mb - 1);
        return sent ? std::optional<double>(*sent + costs_[s - 1].transfer) : std::nullopt;
      }
      case ActionType::RecvGradient:  // sized by the activation it belongs to, so posted after sending it
        return done(ActionType::SendActivation, s, mb);
    }
    return std::nullopt;
  }

  std::string waits_for(const Action& action) const {
    const int s = action.stage, mb = action.microbatch;
    switch (action.type) {
      case ActionType::Forward: return "stage " + std::to_string(s - 1) + "'s forward of micro-batch " + std::to_string(mb);
      case ActionType::Backward:
      case ActionType::BackwardInput:
        return "its forward or stage " + std::to_string(s + 1) + "'s gradient of micro-batch " + std::to_string(mb);
      case ActionType::BackwardWeight: return "its input-gradient pass I" + std::to_string(mb);
      case ActionType::RecvGradient: return "the send of its activation SEND_F" + std::to_string(mb);
      case ActionType::RecvActivation:
        return "stage " + std::to_string(s - 1) + "'s send of micro-batch " + std::to_string(mb - 1);
      default: return "the compute action that produces it";
    }
  }

  void check_placement_and_completeness() const {
    TORCH_CHECK(ranks_ >= 1, "pipeline schedule: no ranks");
    std::map<Key, int> count;
    for (int rank = 0; rank < ranks_; ++rank) {
      for (const auto& action : lists_[rank]) {
        TORCH_CHECK(action.stage >= 0 && action.stage < stages_ && action.microbatch >= 0 &&
                        action.microbatch < microbatches_,
                    "pipeline schedule: rank ", rank, " has ", to_string(action), " outside ", stages_,
                    " stages x ", microbatches_, " micro-batches");
        TORCH_CHECK(rank_of_stage(action.stage, ranks_) == rank, "pipeline schedule: ", to_string(action),
                    " is listed on rank ", rank, " but stage ", action.stage, " lives on rank ",
                    rank_of_stage(action.stage, ranks_));
        TORCH_CHECK(++count[key_of(action)] == 1, "pipeline schedule: ", to_string(action), " appears twice on rank ",
                    rank);
      }
    }
    auto has = [&](ActionType type, int stage, int mb) { return count.count({type, stage, mb}) > 0; };
    for (int stage = 0; stage < stages_; ++stage) {
      for (int mb = 0; mb < microbatches_; ++mb) {
        const std::string where = " of stage " + std::to_string(stage) + ", micro-batch " + std::to_string(mb);
        TORCH_CHECK(has(ActionType::Forward, stage, mb), "pipeline schedule: no forward", where);
        const bool full = has(ActionType::Backward, stage, mb);
        const bool split = has(ActionType::BackwardInput, stage, mb);
        TORCH_CHECK(full != split, "pipeline schedule: ", full ? "both B and I" : "no backward", where);
        TORCH_CHECK(split == has(ActionType::BackwardWeight, stage, mb), "pipeline schedule: ",
                    split ? "I without W" : "W without I", where);
        if (stage + 1 < stages_ && remote(stage, stage + 1)) {
          TORCH_CHECK(has(ActionType::SendActivation, stage, mb) && has(ActionType::RecvActivation, stage + 1, mb),
                      "pipeline schedule: the activation", where, " is not both sent and received");
        }
        if (stage > 0 && remote(stage, stage - 1)) {
          TORCH_CHECK(has(ActionType::SendGradient, stage, mb) && has(ActionType::RecvGradient, stage - 1, mb),
                      "pipeline schedule: the input gradient", where, " is not both sent and received");
        }
      }
    }
  }

  const std::vector<std::vector<Action>>& lists_;
  int ranks_;
  int stages_;
  int microbatches_;
  std::vector<ActionCosts> costs_;  // per stage
  std::map<Key, double> finished_;
};

} // namespace

std::vector<ActionCosts> parse_stage_costs(const std::vector<std::map<std::string, double>>& stage_costs) {
  static const std::pair<std::string, double ActionCosts::*> fields[] = {
      {"forward", &ActionCosts::forward},
      {"backward", &ActionCosts::backward},
      {"backward_input", &ActionCosts::backward_input},
      {"backward_weight", &ActionCosts::backward_weight},
      {"transfer", &ActionCosts::transfer},
  };
  std::vector<ActionCosts> costs;
  for (const auto& named : stage_costs) {
    ActionCosts stage;
    for (const auto& [name, value] : named) {
      const auto field = std::find_if(std::begin(fields), std::end(fields),
                                      [&name = name](const auto& field) { return field.first == name; });
      if (field == std::end(fields)) {
        std::vector<std::string> known;
        for (const auto& entry : fields) {
          known.push_back(entry.first);
        }
        TORCH_CHECK(false, "simulate_stages: unknown cost '", name, "' (", c10::Join(", ", known), ")");
      }
      stage.*(field->second) = value;
    }
    costs.push_back(stage);
  }
  return costs;
}

Simulation simulate(const std::vector<std::vector<Action>>& rank_actions, int stages, int microbatches,
                    const ActionCosts& costs) {
  return Simulator(rank_actions, stages, microbatches, std::vector<ActionCosts>(std::max(stages, 0), costs)).run();
}

Simulation simulate(const ScheduleSpec& spec, const ActionCosts& costs) {
  return simulate(all_rank_actions(spec), spec.stages(), spec.microbatches, costs);
}

Simulation simulate(const ScheduleSpec& spec, const std::vector<ActionCosts>& stage_costs) {
  return Simulator(all_rank_actions(spec), spec.stages(), spec.microbatches, stage_costs).run();
}

std::string render_grid(const Simulation& simulation) {
  double unit = 0;
  for (const auto& row : simulation.timeline) {
    for (const auto& timed : row) {
      const double length = timed.end - timed.start;
      unit = unit == 0 ? length : std::min(unit, length);
    }
  }
  if (unit <= 0) {
    return "";
  }
  const bool virtual_stages = simulation.stages > simulation.ranks;
  const int columns = static_cast<int>(std::lround(simulation.makespan / unit));
  std::vector<std::vector<std::string>> cells(simulation.ranks, std::vector<std::string>(columns, "."));
  size_t width = 1;
  for (int rank = 0; rank < simulation.ranks; ++rank) {
    for (const auto& timed : simulation.timeline[rank]) {
      std::string label = std::string(action_type_name(timed.action.type)) + std::to_string(timed.action.microbatch);
      if (virtual_stages) {
        label.push_back('s');
        label.append(std::to_string(timed.action.stage));
      }
      width = std::max(width, label.size());
      const int first = static_cast<int>(std::lround(timed.start / unit));
      const int last = static_cast<int>(std::lround(timed.end / unit));
      for (int column = first; column < last && column < columns; ++column) {
        cells[rank][column] = label;
      }
    }
  }
  std::ostringstream grid;
  for (int rank = 0; rank < simulation.ranks; ++rank) {
    grid << "rank " << rank << " |";
    for (const auto& cell : cells[rank]) {
      grid << ' ' << cell << std::string(width - cell.size(), ' ');
    }
    grid << '\n';
  }
  return grid.str();
}

} // namespace torchpar::pipeline
