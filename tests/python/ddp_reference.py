"""Models, data and the single-process reference that DDP tests compare against.

The reference runs the global batch in one process, shard by shard: shard r is what rank r sees,
each shard's loss is divided by the world size and backward accumulates, so the gradient is the
mean over the global batch. Shards matter only where a model's forward depends on the batch it
sees (BatchNorm normalises over each rank's own batch, as in torch's DDP without SyncBatchNorm;
branches chosen per rank); there, the reference keeps rank 0's BatchNorm running statistics, which
DDP's broadcast_buffers gives every rank.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

CLASSES = 5


class EmbeddingBagModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(40, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(dim=1))


class TwoBranchModel(nn.Module):
    """Branch ``rare`` is used only when the caller says so: find_unused_parameters territory."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(12, 16)
        self.common = nn.Linear(16, CLASSES)
        self.rare = nn.Linear(16, CLASSES)
        self.never = nn.Linear(16, CLASSES)  # registered, never called

    def forward(self, x: torch.Tensor, use_rare: bool = False) -> torch.Tensor:
        hidden = torch.relu(self.trunk(x))
        out = self.common(hidden)
        return out + self.rare(hidden) if use_rare else out


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)  # every rank builds the same initial replica
    if name == "mlp":
        return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    if name == "cnn_bn":
        return nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, CLASSES)
        )
    if name == "embedding":
        return EmbeddingBagModel()
    if name == "two_branch":
        return TwoBranchModel()
    raise ValueError(name)


def make_batch(name: str, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "cnn_bn":
        inputs = torch.randn(size, 1, 6, 6, generator=generator)
    elif name == "embedding":
        inputs = torch.randint(0, 40, (size, 5), generator=generator)
    else:
        inputs = torch.randn(size, 12, generator=generator)
    return inputs, torch.randint(0, CLASSES, (size,), generator=generator)


def global_batches(name: str, steps: int, world: int, per_rank: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [make_batch(name, world * per_rank, generator) for _ in range(steps)]


def shard(batch, rank: int, world: int):
    return tuple(t.chunk(world)[rank] for t in batch)


def loss_of(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, targets)


def reference_step(
    model: nn.Module,
    batch,
    world: int,
    active_ranks: list[int] | None = None,
    forward: Callable = lambda model, inputs, rank: model(inputs),
) -> None:
    """Accumulates into .grad the gradient DDP averages: sum over (active) shards of shard loss / world."""
    active_ranks = list(range(world)) if active_ranks is None else active_ranks
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    after_first = None
    for rank in active_ranks:
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(before[name])
        inputs, targets = shard(batch, rank, world)
        (loss_of(forward(model, inputs, rank), targets) / world).backward()
        if after_first is None:
            after_first = {name: buffer.clone() for name, buffer in model.named_buffers()}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(after_first[name])


def train_step_beside_reference(
    ddp, optimizer, reference, reference_optimizer, batch, rank: int, world: int, set_to_none: bool = True,
    forward: Callable = lambda model, inputs, rank: model(inputs),
) -> None:
    """One step of DDP on this rank's shard and one of the single-process reference on the global batch."""
    optimizer.zero_grad(set_to_none=set_to_none)
    inputs, targets = shard(batch, rank, world)
    loss_of(forward(ddp, inputs, rank), targets).backward()
    optimizer.step()
    reference_optimizer.zero_grad()
    reference_step(reference, batch, world, forward=forward)
    reference_optimizer.step()


def max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def reference_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
