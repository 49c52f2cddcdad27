"""Models and the single-process reference the pipeline tests compare against."""
from __future__ import annotations

import copy

import torch
from torch import nn

FEATURES, CLASSES = 12, 5


def deep_mlp(layers: int = 9, width: int = 16) -> nn.Sequential:
    """Linear/Tanh alternating, ``layers`` modules in all (at least 8: enough for 4 ranks x 2 virtual stages)."""
    torch.manual_seed(0)
    modules: list[nn.Module] = [nn.Linear(FEATURES, width)]
    while len(modules) < layers - 1:
        modules += [nn.Tanh(), nn.Linear(width, width)] if len(modules) < layers - 2 else [nn.Tanh()]
    modules.append(nn.Linear(width, CLASSES))
    return nn.Sequential(*modules)


def batch(size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, FEATURES, generator=generator), torch.randint(0, CLASSES, (size,), generator=generator)


def reference_gradients(model: nn.Module, inputs, target, loss_fn=nn.functional.cross_entropy):
    """Loss and every parameter's gradient of one single-process step on the whole batch."""
    model = copy.deepcopy(model)
    model.zero_grad()
    outputs = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    loss = loss_fn(outputs, target)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def layer_parameter_names(model: nn.Sequential, layer_indices) -> list[str]:
    """The reference's parameter names of the given layers, in the order the pipeline lists them."""
    names = []
    for index in layer_indices:
        names += [f"{index}.{name}" for name, _ in model[index].named_parameters()]
    return names


def own_layers(pipe) -> list[int]:
    boundaries = [0]
    for count in pipe.balance:
        boundaries.append(boundaries[-1] + count)
    return [i for stage in pipe.stages for i in range(boundaries[stage], boundaries[stage + 1])]


def assert_matches_reference(pipe, model, loss, expected_loss, expected_grads, atol=1e-5):
    """The pipeline's loss and this rank's gradients equal the single-process step's."""
    assert loss is not None and torch.allclose(loss.float(), expected_loss.float(), atol=atol), (loss, expected_loss)
    names = layer_parameter_names(model, own_layers(pipe))
    parameters = pipe.parameters()
    assert len(names) == len(parameters), (names, len(parameters))
    for name, parameter in zip(names, parameters):
        assert parameter.grad is not None, f"{name} got no gradient"
        difference = (parameter.grad - expected_grads[name]).abs().max().item()
        assert difference <= atol, f"{name}: gradient differs from single-process training by {difference:.3g}"
    return names
