#include <torchpar/pipeline/layer_profile.h>

#include <ATen/ops/ones_like.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>

namespace torchpar::pipeline {

std::vector<double> count_layer_parameters(const std::vector<LayerFactory>& factories) {
  std::vector<double> counts;
  for (const auto& factory : factories) {
    double count = 0;
    for (const auto& parameter : factory().parameters) {
      count += static_cast<double>(parameter.numel());
    }
    counts.push_back(count);
  }
  return counts;
}

std::vector<double> measure_layer_milliseconds(const std::vector<LayerFactory>& factories, const Tensors& sample,
                                               int repeats) {
  TORCH_CHECK(!sample.empty(), "pipeline balance_by=\"time\" needs sample_input (one micro-batch of inputs)");
  std::vector<double> milliseconds;
  Tensors current = sample;
  for (size_t index = 0; index < factories.size(); ++index) {
    Layer layer = factories[index]();
    Tensors inputs;
    for (const auto& tensor : current) {
      const bool differentiable = c10::isFloatingType(tensor.scalar_type());
      inputs.push_back(differentiable ? tensor.detach().requires_grad_(true) : tensor);
    }
    std::vector<double> samples;
    Tensors outputs;
    for (int run = 0; run <= repeats; ++run) {  // run 0 warms up (allocations, lazy init)
      const auto start = std::chrono::steady_clock::now();
      outputs = layer.forward(inputs);
      Tensors roots, grads;
      for (const auto& output : outputs) {
        if (output.requires_grad()) {
          roots.push_back(output);
          grads.push_back(at::ones_like(output));
        }
      }
      if (!roots.empty()) {
        torch::autograd::backward(roots, grads);
      }
      const std::chrono::duration<double, std::milli> elapsed = std::chrono::steady_clock::now() - start;
      if (run > 0) {
        samples.push_back(elapsed.count());
      }
    }
    for (auto& parameter : layer.parameters) {  // the factory may hand out a layer the pipeline keeps
      parameter.mutable_grad() = at::Tensor();
    }
    std::nth_element(samples.begin(), samples.begin() + samples.size() / 2, samples.end());
    milliseconds.push_back(samples[samples.size() / 2]);
    current.clear();
    for (const auto& output : outputs) {
      current.push_back(output.detach());
    }
  }
  return milliseconds;
}

} // namespace torchpar::pipeline
