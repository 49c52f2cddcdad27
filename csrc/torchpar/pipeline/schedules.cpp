#include <torchpar/pipeline/schedules.h>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <utility>

namespace torchpar::pipeline {
namespace {

Action forward(int stage, int microbatch) { return {ActionType::Forward, stage, microbatch}; }
Action backward(int stage, int microbatch) { return {ActionType::Backward, stage, microbatch}; }

std::vector<Action> gpipe(const ScheduleSpec& spec, int rank) {
  std::vector<Action> actions;
  for (int mb = 0; mb < spec.microbatches; ++mb) {
    actions.push_back(forward(rank, mb));
  }
  for (int mb = 0; mb < spec.microbatches; ++mb) {
    actions.push_back(backward(rank, mb));
  }
  return actions;
}

// Rank r runs p-r-1 warm-up forwards, then one forward and one backward in turn, then the
// remaining backwards: micro-batch k's activations are freed before micro-batch k+p-r is started.
std::vector<Action> one_f_one_b(const ScheduleSpec& spec, int rank) {
  const int m = spec.microbatches;
  const int warmup = std::min(spec.ranks - rank - 1, m);
  std::vector<Action> actions;
  for (int mb = 0; mb < warmup; ++mb) {
    actions.push_back(forward(rank, mb));
  }
  for (int mb = 0; mb < m - warmup; ++mb) {
    actions.push_back(forward(rank, warmup + mb));
    actions.push_back(backward(rank, mb));
  }
  for (int mb = m - warmup; mb < m; ++mb) {
    actions.push_back(backward(rank, mb));
  }
  return actions;
}

// Megatron-LM's forward_backward_pipelining_with_interleaving: micro-batches go through the rank's
// v model chunks in groups of p; chunk c of rank r is virtual stage c*p + r.
std::vector<Action> interleaved(const ScheduleSpec& spec, int rank) {
  const int p = spec.ranks, v = spec.virtual_stages, m = spec.microbatches;
  const int total = m * v;
  auto microbatch_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto forward_stage = [&](int k) { return ((k / p) % v) * p + rank; };
  auto backward_stage = [&](int k) { return (v - 1 - (k / p) % v) * p + rank; };
  const int warmup = m == p ? total : std::min((p - rank - 1) * 2 + (v - 1) * p, total);

  std::vector<Action> actions;
  for (int k = 0; k < warmup; ++k) {
    actions.push_back(forward(forward_stage(k), microbatch_of(k)));
  }
  for (int k = 0; k < total - warmup; ++k) {
    actions.push_back(forward(forward_stage(warmup + k), microbatch_of(warmup + k)));
    actions.push_back(backward(backward_stage(k), microbatch_of(k)));
  }
  for (int k = total - warmup; k < total; ++k) {
    actions.push_back(backward(backward_stage(k), microbatch_of(k)));
  }
  return actions;
}

// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with the backward split into
// I (input gradient, on the critical path) and W (weight gradient, off it). Rank r starts with p-r
// forwards and lets its first r weight-gradient passes wait, so that the input-gradient chain runs
// ahead; the postponed W fill what would be 1F1B's cool-down bubble. With equal F, I and W times
// the bubble is (p-1)/(3m+p-1) for m >= p, a third of 1F1B's, at 1F1B's peak of p micro-batches.
std::vector<Action> zero_bubble_h1(const ScheduleSpec& spec, int rank) {
  const int m = spec.microbatches;
  std::vector<Action> actions;
  int forwards = 0, weights = 0;
  for (; forwards < std::min(spec.ranks - rank, m); ++forwards) {
    actions.push_back(forward(rank, forwards));
  }
  for (int mb = 0; mb < m; ++mb) {
    actions.push_back({ActionType::BackwardInput, rank, mb});
    if (mb >= rank) {
      actions.push_back({ActionType::BackwardWeight, rank, weights++});
    }
    if (forwards < m) {
      actions.push_back(forward(rank, forwards++));
    }
  }
  for (; weights < m; ++weights) {
    actions.push_back({ActionType::BackwardWeight, rank, weights});
  }
  return actions;
}

bool consumes_remote_input(const Action& action, int ranks, int stages) {
  const int here = rank_of_stage(action.stage, ranks);
  if (action.type == ActionType::Forward) {
    return action.stage > 0 && rank_of_stage(action.stage - 1, ranks) != here;
  }
  if (action.type == ActionType::Backward || action.type == ActionType::BackwardInput) {
    return action.stage < stages - 1 && rank_of_stage(action.stage + 1, ranks) != here;
  }
  return false;
}

bool produces_remote_output(const Action& action, int ranks, int stages) {
  const int here = rank_of_stage(action.stage, ranks);
  if (action.type == ActionType::Forward) {
    return action.stage < stages - 1 && rank_of_stage(action.stage + 1, ranks) != here;
  }
  if (action.type == ActionType::Backward || action.type == ActionType::BackwardInput) {
    return action.stage > 0 && rank_of_stage(action.stage - 1, ranks) != here;
  }
  return false;
}

constexpr ScheduleKind kScheduleKinds[] = {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved1F1B,
                                           ScheduleKind::ZeroBubbleH1};

} // namespace

std::vector<std::string> schedule_names() {
  std::vector<std::string> names;
  for (auto kind : kScheduleKinds) {
    names.push_back(schedule_name(kind));
  }
  return names;
}

ScheduleKind parse_schedule(const std::string& name) {
  std::string key = name;
  std::transform(key.begin(), key.end(), key.begin(), [](unsigned char c) {
    return c == '-' ? '_' : static_cast<char>(std::tolower(c));
  });
  for (auto kind : kScheduleKinds) {
    if (key == schedule_name(kind)) {
      return kind;
    }
  }
  static const std::pair<const char*, ScheduleKind> aliases[] = {
      {"one_f_one_b", ScheduleKind::OneFOneB},
      {"interleaved_1f1b", ScheduleKind::Interleaved1F1B},
      {"interleaved1f1b", ScheduleKind::Interleaved1F1B},
      {"zb_h1", ScheduleKind::ZeroBubbleH1},
      {"zbh1", ScheduleKind::ZeroBubbleH1},
      {"zero_bubble_h1", ScheduleKind::ZeroBubbleH1},
  };
  for (const auto& [alias, kind] : aliases) {
    if (key == alias) {
      return kind;
    }
  }
  TORCH_CHECK(false, "unknown pipeline schedule '", name, "' (", c10::Join(", ", schedule_names()), ")");
}

std::string schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::GPipe: return "gpipe";
    case ScheduleKind::OneFOneB: return "1f1b";
    case ScheduleKind::Interleaved1F1B: return "interleaved";
    case ScheduleKind::ZeroBubbleH1: return "zero_bubble";
  }
  return "?";
}

void check_schedule(const ScheduleSpec& spec) {
  const auto name = schedule_name(spec.kind);
  TORCH_CHECK(spec.ranks >= 1, "pipeline schedule ", name, ": needs at least 1 rank, got ", spec.ranks);
  TORCH_CHECK(spec.microbatches >= 1, "pipeline schedule ", name, ": needs at least 1 micro-batch, got ",
              spec.microbatches);
  TORCH_CHECK(spec.virtual_stages >= 1, "pipeline schedule ", name, ": virtual_stages must be >= 1, got ",
              spec.virtual_stages);
  if (spec.kind == ScheduleKind::Interleaved1F1B) {
    TORCH_CHECK(spec.microbatches % spec.ranks == 0, "pipeline schedule interleaved: micro-batches (",
                spec.microbatches, ") must be a multiple of the pipeline ranks (", spec.ranks,
                "); micro-batches travel through the virtual stages in groups of ", spec.ranks);
  } else {
    TORCH_CHECK(spec.virtual_stages == 1, "pipeline schedule ", name, " runs one stage per rank; ",
                "virtual_stages=", spec.virtual_stages, " needs schedule 'interleaved'");
  }
}

std::vector<Action> compute_actions(const ScheduleSpec& spec, int rank) {
  check_schedule(spec);
  TORCH_CHECK(rank >= 0 && rank < spec.ranks, "pipeline schedule: rank ", rank, " outside 0..", spec.ranks - 1);
  switch (spec.kind) {
    case ScheduleKind::GPipe: return gpipe(spec, rank);
    case ScheduleKind::OneFOneB: return one_f_one_b(spec, rank);
    case ScheduleKind::Interleaved1F1B: return interleaved(spec, rank);
    case ScheduleKind::ZeroBubbleH1: return zero_bubble_h1(spec, rank);
  }
  return {};
}

std::vector<Action> rank_actions(const ScheduleSpec& spec, int rank) {
  const auto compute = compute_actions(spec, rank);
  const int stages = spec.stages();
  auto receive = [](const Action& consumer) {
    return Action{consumer.type == ActionType::Forward ? ActionType::RecvActivation : ActionType::RecvGradient,
                  consumer.stage, consumer.microbatch};
  };
  std::vector<Action> actions;
  if (!compute.empty() && consumes_remote_input(compute.front(), spec.ranks, stages)) {
    actions.push_back(receive(compute.front()));
  }
  for (size_t i = 0; i < compute.size(); ++i) {
    const bool receive_next = i + 1 < compute.size() && consumes_remote_input(compute[i + 1], spec.ranks, stages);
    // A gradient's receive is sized by the activation it belongs to, so it cannot be posted
    // before that activation was computed and sent.
    const bool after_own_forward = receive_next && compute[i].type == ActionType::Forward &&
                                   compute[i + 1].type != ActionType::Forward &&
                                   compute[i].stage == compute[i + 1].stage &&
                                   compute[i].microbatch == compute[i + 1].microbatch;
    if (receive_next && !after_own_forward) {
      actions.push_back(receive(compute[i + 1]));
    }
    actions.push_back(compute[i]);
    if (produces_remote_output(compute[i], spec.ranks, stages)) {
      actions.push_back({compute[i].type == ActionType::Forward ? ActionType::SendActivation
                                                                 : ActionType::SendGradient,
                         compute[i].stage, compute[i].microbatch});
    }
    if (after_own_forward) {
      actions.push_back(receive(compute[i + 1]));
    }
  }
  return actions;
}

std::vector<std::vector<Action>> all_rank_actions(const ScheduleSpec& spec) {
  std::vector<std::vector<Action>> actions;
  for (int rank = 0; rank < spec.ranks; ++rank) {
    actions.push_back(rank_actions(spec, rank));
  }
  return actions;
}

} // namespace torchpar::pipeline
