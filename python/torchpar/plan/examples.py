"""Models to plan for, as ``python -m torchpar.plan --model torchpar.plan.examples:<name>`` loads them.

A model for the planner is a :class:`torchpar.plan.Model`: its layers (the pipeline's unit of cutting),
a function giving a batch of inputs and targets, the loss, and the optimizer.
"""
from __future__ import annotations

import torch
from torch import nn

from torchpar.plan.model import Model


def digits_mlp() -> Model:
    """The examples' MLP for 8x8 digits: 64-128-10."""
    return Model(layers=[nn.Sequential(nn.Linear(64, 128), nn.ReLU()), nn.Linear(128, 10)],
                 sample=lambda batch: (torch.randn(batch, 64), torch.randint(0, 10, (batch,))),
                 loss=nn.functional.cross_entropy)


def deep_mlp(depth: int = 8, width: int = 512) -> Model:
    """A deep narrow MLP: `depth` Linear+ReLU layers of `width` (a pipeline's natural case once its
    parameters, gradients and optimizer state exceed a rank's memory)."""
    layers = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 1)] + [nn.Linear(width, 10)]
    return Model(layers=layers, sample=lambda batch: (torch.randn(batch, width), torch.randint(0, 10, (batch,))),
                 loss=nn.functional.cross_entropy)


class _BagEmbedding(nn.Module):
    def __init__(self, rows: int, dim: int, mode: str = "mean"):
        super().__init__()
        self.embedding = nn.EmbeddingBag(rows, dim, mode=mode)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)


def wide_embedding(rows: int = 200_000, dim: int = 64) -> Model:
    """A wide embedding (`rows` x `dim`, averaged over 8 ids per sample) under a small MLP, trained with
    Adam: most bytes, little compute (the parameter server's natural case under a memory cap)."""
    layers = [_BagEmbedding(rows, dim), nn.Sequential(nn.Linear(dim, 64), nn.ReLU()), nn.Linear(64, 2)]
    return Model(layers=layers,
                 sample=lambda batch: (torch.randint(0, rows, (batch, 8)), torch.randint(0, 2, (batch,))),
                 loss=nn.functional.cross_entropy, optimizer="adam")


def digits_deep_mlp(depth: int = 8, hidden: int = 128) -> Model:
    """The pipeline example's MLP for 8x8 digits: 64, then `depth - 1` Linear+ReLU blocks of `hidden`, then 10."""
    widths = [64] + [hidden] * (depth - 1)
    layers = [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])] + [nn.Linear(hidden, 10)]
    return Model(layers=layers, sample=lambda batch: (torch.randn(batch, 64), torch.randint(0, 10, (batch,))),
                 loss=nn.functional.cross_entropy)


def digits_cpp_deep_mlp() -> Model:
    """The C++ pipeline example's MLP (examples/cpp/train_pipeline): 64-128x4-10, five Linear layers."""
    return digits_deep_mlp(depth=5)


def digits_wide_mlp(hidden: int = 1024, layers: int = 6) -> Model:
    """The sharded example's MLP for 8x8 digits (examples/*/train_sharded): 64-`hidden`x`layers`-10, Adam; 5.3 M
    parameters at 6 hidden layers of 1024, whose DDP peak (103 MiB per rank on 4 ranks) outgrows a small memory cap."""
    widths = [64] + [hidden] * layers
    layers_ = [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])] + [nn.Linear(hidden, 10)]
    return Model(layers=layers_, sample=lambda batch: (torch.randn(batch, 64), torch.randint(0, 10, (batch,))),
                 loss=nn.functional.cross_entropy, optimizer="adam", lr=1e-3)


# Held out: models no test tunes the planner to, on which docs/planner.md reports its predictions against
# what was measured.

class _Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.inner(x))


def residual_mlp(depth: int = 6, width: int = 384) -> Model:
    """Held out: `depth` residual blocks (two Linear of `width`, a skip connection), then Linear(width, 10)."""
    layers = [_Residual(width) for _ in range(depth)] + [nn.Linear(width, 10)]
    return Model(layers=layers, sample=lambda batch: (torch.randn(batch, width), torch.randint(0, 10, (batch,))),
                 loss=nn.functional.cross_entropy)


def conv1d_net(channels: int = 64, length: int = 128) -> Model:
    """Held out: three Conv1d(kernel 5)+ReLU over 8 input channels of `length` samples, then a Linear classifier:
    little parameter memory, much activation memory."""
    layers = [nn.Sequential(nn.Conv1d(8, channels, 5, padding=2), nn.ReLU()),
              nn.Sequential(nn.Conv1d(channels, channels, 5, padding=2), nn.ReLU()),
              nn.Sequential(nn.Conv1d(channels, channels, 5, padding=2), nn.ReLU(), nn.Flatten()),
              nn.Linear(channels * length, 10)]
    return Model(layers=layers, sample=lambda batch: (torch.randn(batch, 8, length), torch.randint(0, 10, (batch,))),
                 loss=nn.functional.cross_entropy)


def recommender(rows: int = 100_000, dim: int = 64) -> Model:
    """Held out: a 24 MiB embedding (`rows` x `dim`, summed over 16 ids per sample) under a 256-wide MLP, SGD."""
    layers = [_BagEmbedding(rows, dim, mode="sum"), nn.Sequential(nn.Linear(dim, 256), nn.ReLU()),
              nn.Sequential(nn.Linear(256, 256), nn.ReLU()), nn.Linear(256, 2)]
    return Model(layers=layers,
                 sample=lambda batch: (torch.randint(0, rows, (batch, 16)), torch.randint(0, 2, (batch,))),
                 loss=nn.functional.cross_entropy)
