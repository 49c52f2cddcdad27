// Cutting a sequence of layers into contiguous pipeline stages.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace torchpar::pipeline {

// Layers per stage, as equal as possible (earlier stages take the remainder).
std::vector<int64_t> uniform_partition(int64_t layers, int64_t stages);

// Layers per stage for the contiguous split that minimises the most expensive stage (costs: one
// per layer, e.g. parameter counts or measured seconds). Exact, by dynamic programming.
std::vector<int64_t> balanced_partition(const std::vector<double>& costs, int64_t stages);

// Throws unless `balance` gives every one of `stages` stages at least one layer and covers `layers`.
void check_partition(const std::vector<int64_t>& balance, int64_t layers, int64_t stages);

// Index of each stage's first layer, plus the total at the end.
std::vector<int64_t> stage_boundaries(const std::vector<int64_t>& balance);

std::vector<double> stage_costs(const std::vector<double>& costs, const std::vector<int64_t>& balance);

// "stage 0: layers 0-2 (3 layers), predicted 1.2 ms" per line; `unit` names the cost ("ms",
// "parameters"; "layers" prints no cost, the layer count says it).
std::string describe_partition(const std::vector<int64_t>& balance, const std::vector<double>& costs,
                               const std::string& unit);

} // namespace torchpar::pipeline
