"""What the planner needs to know about a model."""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Sequence

import torch
from torch import nn

OPTIMIZER_STATE = {"sgd": 1.0, "adam": 2.0}  # bytes of state per parameter byte (SGD with momentum; Adam's moments)


@dataclasses.dataclass
class Model:
    """layers: modules or zero-argument factories (the pipeline's unit of cutting; nn.Sequential of them
    is the whole model); sample(batch) -> (inputs, targets); loss(output, targets) -> scalar;
    optimizer: "sgd" (with momentum) or "adam"; lr: its learning rate."""

    layers: Sequence[nn.Module | Callable[[], nn.Module]]
    sample: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: str = "sgd"
    lr: float = 0.01

    def __post_init__(self):
        if self.optimizer not in OPTIMIZER_STATE:
            raise ValueError(f"Model.optimizer must be one of {sorted(OPTIMIZER_STATE)}, got {self.optimizer!r}")

    def build(self, index: int) -> nn.Module:
        """Layer `index`, built by its factory if it has one."""
        layer = self.layers[index]
        return layer if isinstance(layer, nn.Module) else layer()

    def optimizer_class(self) -> tuple[type[torch.optim.Optimizer], dict]:
        """The optimizer's class and arguments (as ZeroRedundancyOptimizer and ShardedOptimizer take them)."""
        if self.optimizer == "adam":
            return torch.optim.Adam, dict(lr=self.lr)
        return torch.optim.SGD, dict(lr=self.lr, momentum=0.9)

    def make_optimizer(self, parameters) -> torch.optim.Optimizer:
        optimizer_class, defaults = self.optimizer_class()
        return optimizer_class(parameters, **defaults)


def load_model(spec: str) -> Model:
    """'package.module:factory' -> factory(), which must return a Model."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--model {spec!r}: expected 'package.module:factory'")
    factory = getattr(importlib.import_module(module_name), attribute, None)
    if factory is None:
        raise ValueError(f"--model {spec!r}: module {module_name} has no {attribute!r}")
    model = factory()
    if not isinstance(model, Model):
        raise TypeError(f"--model {spec!r}: the factory returned {type(model).__name__}, not a torchpar.plan.Model")
    return model
