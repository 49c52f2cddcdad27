"""What torchpar's data-parallel wrappers (DDP, sharded) share on the Python side."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch


@contextlib.contextmanager
def sync_disabled(coordinator: Any) -> Iterator[None]:
    """The C++ coordinator's gradient synchronisation off inside, restored after (torch's ``no_sync``)."""
    previous = coordinator.grad_sync
    coordinator.grad_sync = False
    try:
        yield
    finally:
        coordinator.grad_sync = previous


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a forward's output (nested tuples, lists, dicts, dataclasses)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for field in dataclasses.fields(value) for t in tensors_in(getattr(value, field.name))]
    return []
