#include <torchpar/pipeline/partition.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <numeric>
#include <sstream>

namespace torchpar::pipeline {

std::vector<int64_t> uniform_partition(int64_t layers, int64_t stages) {
  TORCH_CHECK(stages >= 1 && layers >= stages, "pipeline partition: ", layers, " layers cannot fill ", stages,
              " stages (every stage needs at least one layer)");
  std::vector<int64_t> balance(stages, layers / stages);
  for (int64_t stage = 0; stage < layers % stages; ++stage) {
    ++balance[stage];
  }
  return balance;
}

std::vector<int64_t> balanced_partition(const std::vector<double>& costs, int64_t stages) {
  const auto layers = static_cast<int64_t>(costs.size());
  TORCH_CHECK(stages >= 1 && layers >= stages, "pipeline partition: ", layers, " layers cannot fill ", stages,
              " stages (every stage needs at least one layer)");
  std::vector<double> prefix(layers + 1, 0.0);
  for (int64_t i = 0; i < layers; ++i) {
    TORCH_CHECK(costs[i] >= 0, "pipeline partition: layer ", i, " has negative cost ", costs[i]);
    prefix[i + 1] = prefix[i] + costs[i];
  }
  constexpr double kInfinity = std::numeric_limits<double>::infinity();
  // best[s][i]: the smallest possible slowest stage when the first i layers form s stages.
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(layers + 1, kInfinity));
  std::vector<std::vector<int64_t>> cut(stages + 1, std::vector<int64_t>(layers + 1, 0));
  best[0][0] = 0;
  for (int64_t s = 1; s <= stages; ++s) {
    for (int64_t i = s; i <= layers - (stages - s); ++i) {
      for (int64_t j = s - 1; j < i; ++j) {
        const double slowest = std::max(best[s - 1][j], prefix[i] - prefix[j]);
        if (slowest < best[s][i]) {
          best[s][i] = slowest;
          cut[s][i] = j;
        }
      }
    }
  }
  std::vector<int64_t> balance(stages);
  for (int64_t s = stages, i = layers; s >= 1; --s) {
    balance[s - 1] = i - cut[s][i];
    i = cut[s][i];
  }
  return balance;
}

void check_partition(const std::vector<int64_t>& balance, int64_t layers, int64_t stages) {
  std::ostringstream given;
  for (size_t i = 0; i < balance.size(); ++i) {
    given << (i ? ", " : "") << balance[i];
  }
  TORCH_CHECK(static_cast<int64_t>(balance.size()) == stages, "pipeline partition: balance [", given.str(),
              "] has ", balance.size(), " entries for ", stages, " stages");
  TORCH_CHECK(std::all_of(balance.begin(), balance.end(), [](int64_t n) { return n >= 1; }),
              "pipeline partition: balance [", given.str(), "] leaves a stage without layers");
  TORCH_CHECK(std::accumulate(balance.begin(), balance.end(), int64_t{0}) == layers, "pipeline partition: balance [",
              given.str(), "] covers ", std::accumulate(balance.begin(), balance.end(), int64_t{0}), " layers, the model has ",
              layers);
}

std::vector<int64_t> stage_boundaries(const std::vector<int64_t>& balance) {
  std::vector<int64_t> boundaries{0};
  for (auto n : balance) {
    boundaries.push_back(boundaries.back() + n);
  }
  return boundaries;
}

std::vector<double> stage_costs(const std::vector<double>& costs, const std::vector<int64_t>& balance) {
  check_partition(balance, static_cast<int64_t>(costs.size()), static_cast<int64_t>(balance.size()));
  const auto boundaries = stage_boundaries(balance);
  std::vector<double> sums;
  for (size_t s = 0; s < balance.size(); ++s) {
    sums.push_back(std::accumulate(costs.begin() + boundaries[s], costs.begin() + boundaries[s + 1], 0.0));
  }
  return sums;
}

std::string describe_partition(const std::vector<int64_t>& balance, const std::vector<double>& costs,
                               const std::string& unit) {
  const auto boundaries = stage_boundaries(balance);
  const auto sums = stage_costs(costs, balance);
  std::ostringstream text;
  for (size_t s = 0; s < balance.size(); ++s) {
    text << "stage " << s << ": layers " << boundaries[s] << "-" << boundaries[s + 1] - 1 << " (" << balance[s]
         << (balance[s] == 1 ? " layer" : " layers") << ")";
    if (unit != "layers") {
      char cost[64];
      std::snprintf(cost, sizeof(cost), "%.4g", sums[s]);
      text << ", predicted " << cost << " " << unit;
    }
    text << "\n";
  }
  return text.str();
}

} // namespace torchpar::pipeline
