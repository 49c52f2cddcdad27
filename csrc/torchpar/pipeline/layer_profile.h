// What the balancer weighs layers by: their parameter counts, or their measured forward+backward time.
#pragma once
#include <torchpar/pipeline/layer.h>

#include <vector>

namespace torchpar::pipeline {

// Builds one layer at a time (never the whole model) and counts its parameters.
std::vector<double> count_layer_parameters(const std::vector<LayerFactory>& factories);

// Builds one layer at a time, feeds it the previous layer's output (starting from `sample`, one
// micro-batch) and returns the median of `repeats` forward+backward times per layer, in milliseconds.
std::vector<double> measure_layer_milliseconds(const std::vector<LayerFactory>& factories, const Tensors& sample,
                                               int repeats = 5);

} // namespace torchpar::pipeline
