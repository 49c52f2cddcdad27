#include <torchpar/pipeline/stage.h>

#include <torchpar/common/error_message.h>
#include <torchpar/common/generator_state.h>
#include <torchpar/pipeline/p2p.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <mutex>

namespace torchpar::pipeline {
namespace {

bool takes_gradient(const at::Tensor& tensor) { return tensor.defined() && tensor.requires_grad(); }

// A leaf standing for `tensor` where gradients must stop and be collected.
at::Tensor boundary_leaf(const at::Tensor& tensor) {
  return takes_gradient(tensor) ? tensor.detach().requires_grad_(true) : tensor;
}

Tensors boundary_leaves(const Tensors& tensors) {
  Tensors leaves;
  for (const auto& tensor : tensors) {
    leaves.push_back(boundary_leaf(tensor));
  }
  return leaves;
}

// The pairs (output, its gradient) autograd can start from; a missing gradient counts as zero.
std::pair<Tensors, Tensors> differentiable(const Tensors& outputs, const Tensors& gradients) {
  Tensors roots, grads;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (takes_gradient(outputs[i])) {
      roots.push_back(outputs[i]);
      const bool given = i < gradients.size() && gradients[i].defined();
      grads.push_back(given ? gradients[i] : at::zeros_like(outputs[i]));
    }
  }
  return {roots, grads};
}

// Gradients of `roots` with respect to `inputs`, one entry per input (undefined where none flows).
Tensors input_gradients(const Tensors& roots, const Tensors& grads, const Tensors& inputs) {
  Tensors wanted;
  for (const auto& input : inputs) {
    if (takes_gradient(input)) {
      wanted.push_back(input);
    }
  }
  Tensors result(inputs.size());
  if (wanted.empty() || roots.empty()) {
    return result;
  }
  auto computed = torch::autograd::grad(roots, wanted, grads, /*retain_graph=*/true, /*create_graph=*/false,
                                        /*allow_unused=*/true);
  for (size_t i = 0, k = 0; i < inputs.size(); ++i) {
    if (takes_gradient(inputs[i])) {
      result[i] = computed[k++];
    }
  }
  return result;
}

// Without backtraces: a C++ one from c10, or the "At:" Python stack pybind11 appends to errors
// raised by Python layers (the stage, micro-batch and layer are named instead).
std::string bare_message(const std::exception& error) {
  std::string message = message_of(error);
  const auto python_stack = message.find("\n\nAt:\n");
  return python_stack == std::string::npos ? message : message.substr(0, python_stack);
}

} // namespace

PipelineStage::PipelineStage(int index, int first_layer, std::vector<Layer> layers, bool checkpoint_activations,
                             bool split_backward, LossFn loss)
    : index_(index), first_layer_(first_layer), layers_(std::move(layers)), checkpoint_(checkpoint_activations),
      split_backward_(split_backward), loss_(std::move(loss)) {
  TORCH_CHECK(!layers_.empty(), "pipeline stage ", index, " has no layers");
  modifies_inputs_.assign(layers_.size(), false);
}

std::string PipelineStage::describe() const {
  return "stage " + std::to_string(index_) + " (layers " + std::to_string(first_layer_) + "-" +
         std::to_string(first_layer_ + static_cast<int>(layers_.size()) - 1) + ")";
}

std::string PipelineStage::where(int microbatch) const {
  return "pipeline " + describe() + ", micro-batch " + std::to_string(microbatch);
}

Tensors PipelineStage::parameters() const {
  Tensors parameters;
  for (const auto& layer : layers_) {
    parameters.insert(parameters.end(), layer.parameters.begin(), layer.parameters.end());
  }
  return parameters;
}

Tensors PipelineStage::call_layer(size_t layer, const Tensors& inputs, int microbatch) {
  // Stage inputs (and, in split backward, every layer's input) are leaves, which a layer starting
  // with an in-place op (ReLU(inplace=True), x += ...) may not modify: such a layer gets copies,
  // from the first time it tries on.
  auto copies = [](const Tensors& tensors) {
    Tensors result;
    for (const auto& tensor : tensors) {
      result.push_back(takes_gradient(tensor) && tensor.is_leaf() ? tensor.clone() : tensor);
    }
    return result;
  };
  for (int attempt = 0;; ++attempt) {
    try {
      return layers_[layer].forward(modifies_inputs_[layer] ? copies(inputs) : inputs);
    } catch (const std::exception& error) {
      const auto message = bare_message(error);
      if (attempt == 0 && !modifies_inputs_[layer] &&
          message.find("leaf Variable that requires grad is being used in an in-place operation") != std::string::npos) {
        modifies_inputs_[layer] = true;
        continue;
      }
      TORCH_CHECK(false, where(microbatch), ": layer ", first_layer_ + static_cast<int>(layer), " (",
                  layers_[layer].name, ") failed on inputs ", pipeline::describe(metas_of(inputs)), ": ", message);
    }
  }
}

void PipelineStage::run(int microbatch, InFlight& state) {
  Tensors current = state.inputs;
  if (!c10::GradMode::is_enabled()) {
    // Without autograd an in-place layer could change the inputs kept for recomputation.
    for (auto& tensor : current) {
      tensor = tensor.clone();
    }
  }
  state.layer_inputs.clear();
  state.layer_outputs.clear();
  for (size_t layer = 0; layer < layers_.size(); ++layer) {
    if (split_backward_ && layer > 0) {
      current = boundary_leaves(current);
    }
    if (split_backward_) {
      state.layer_inputs.push_back(current);
    }
    current = call_layer(layer, current, microbatch);
    if (split_backward_) {
      state.layer_outputs.push_back(current);
    }
  }
  if (!loss_) {
    state.outputs = current;
    return;
  }
  if (split_backward_) {
    state.loss_inputs = boundary_leaves(current);
    current = state.loss_inputs;
  }
  at::Tensor loss;
  try {
    loss = loss_(current, state.target);
  } catch (const std::exception& error) {
    TORCH_CHECK(false, where(microbatch), ": the loss failed on outputs ", pipeline::describe(metas_of(current)),
                " and target ", state.target.defined() ? pipeline::describe(metas_of({state.target})) : "(none)",
                ": ", bare_message(error));
  }
  TORCH_CHECK(loss.defined() && loss.numel() == 1, where(microbatch), ": the loss must be one number, got ",
              loss.defined() ? pipeline::describe(metas_of({loss})) : "nothing");
  state.loss = loss.reshape({}) * state.loss_scale;
  state.outputs = current;
}

Tensors PipelineStage::forward(int microbatch, Tensors inputs, const at::Tensor& target, double loss_scale) {
  TORCH_CHECK(!in_flight_.count(microbatch), where(microbatch), ": forward ran twice without a backward");
  auto& state = in_flight_[microbatch];
  state.inputs = std::move(inputs);
  state.target = target;
  state.loss_scale = loss_scale;
  if (checkpoint_) {
    auto generator = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(generator.mutex());
      state.rng_state = generator.get_state();
    }
    c10::AutoGradMode no_grad(false);
    run(microbatch, state);
    Tensors result = loss_ ? Tensors{state.loss} : state.outputs;
    state.outputs.clear();
    state.loss = at::Tensor();
    state.layer_inputs.clear();
    state.layer_outputs.clear();
    state.loss_inputs.clear();
    return result;
  }
  run(microbatch, state);
  if (loss_) {
    return {state.loss.detach()};
  }
  Tensors detached;
  for (const auto& output : state.outputs) {
    detached.push_back(output.detach());
  }
  return detached;
}

Tensors PipelineStage::infer(const Tensors& inputs) {
  c10::AutoGradMode no_grad(false);
  Tensors current = inputs;
  for (size_t layer = 0; layer < layers_.size(); ++layer) {
    current = call_layer(layer, current, -1);
  }
  return current;
}

PipelineStage::InFlight& PipelineStage::state_of(int microbatch, const char* pass) {
  auto found = in_flight_.find(microbatch);
  TORCH_CHECK(found != in_flight_.end(), where(microbatch), ": ", pass, " before its forward");
  auto& state = found->second;
  if (checkpoint_ && !state.outputs.size() && !state.loss.defined()) {
    GeneratorStateGuard same_randomness(state.rng_state);
    c10::AutoGradMode grad(true);
    run(microbatch, state);
  }
  return state;
}

Tensors PipelineStage::backward(int microbatch, const Tensors& output_gradients) {
  TORCH_CHECK(!split_backward_, where(microbatch), ": full backward on a stage built for split backward");
  auto& state = state_of(microbatch, "backward");
  auto [roots, grads] = loss_ ? (state.loss.requires_grad() ? std::pair<Tensors, Tensors>{{state.loss}, {}}
                                                             : std::pair<Tensors, Tensors>{})
                              : differentiable(state.outputs, output_gradients);
  Tensors result;
  try {
    if (!roots.empty()) {
      torch::autograd::backward(roots, grads);
    }
    for (const auto& input : state.inputs) {
      result.push_back(takes_gradient(input) ? input.grad() : at::Tensor());
    }
  } catch (const std::exception& error) {
    TORCH_CHECK(false, where(microbatch), ": backward failed: ", bare_message(error));
  }
  in_flight_.erase(microbatch);
  return result;
}

Tensors PipelineStage::backward_input(int microbatch, const Tensors& output_gradients) {
  TORCH_CHECK(split_backward_, where(microbatch), ": split backward on a stage built for full backward");
  auto& state = state_of(microbatch, "backward (input gradients)");
  try {
    Tensors gradients = output_gradients;
    if (loss_) {
      gradients = state.loss.requires_grad() ? input_gradients({state.loss}, {}, state.loss_inputs)
                                             : Tensors(state.loss_inputs.size());
    }
    state.output_gradients.assign(layers_.size(), {});
    for (size_t layer = layers_.size(); layer-- > 0;) {
      state.output_gradients[layer] = gradients;
      auto [roots, grads] = differentiable(state.layer_outputs[layer], gradients);
      gradients = input_gradients(roots, grads, state.layer_inputs[layer]);
    }
    return gradients;
  } catch (const std::exception& error) {
    TORCH_CHECK(false, where(microbatch), ": backward (input gradients) failed: ", bare_message(error));
  }
}

void PipelineStage::backward_weight(int microbatch) {
  auto found = in_flight_.find(microbatch);
  TORCH_CHECK(found != in_flight_.end() && !found->second.output_gradients.empty(), where(microbatch),
              ": weight gradients before input gradients");
  auto& state = found->second;
  try {
    for (size_t layer = 0; layer < layers_.size(); ++layer) {
      Tensors weights;
      for (const auto& parameter : layers_[layer].parameters) {
        if (parameter.requires_grad()) {
          weights.push_back(parameter);
        }
      }
      auto [roots, grads] = differentiable(state.layer_outputs[layer], state.output_gradients[layer]);
      if (!weights.empty() && !roots.empty()) {
        torch::autograd::backward(roots, grads, /*retain_graph=*/false, /*create_graph=*/false, weights);
      }
    }
  } catch (const std::exception& error) {
    TORCH_CHECK(false, where(microbatch), ": backward (weight gradients) failed: ", bare_message(error));
  }
  in_flight_.erase(found);
}

} // namespace torchpar::pipeline
