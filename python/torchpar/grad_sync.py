"""What torchpar's data-parallel wrappers (DDP, sharded) share on the Python side."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


@contextlib.contextmanager
def sync_disabled(coordinator: Any) -> Iterator[None]:
    """The C++ coordinator's gradient synchronisation off inside, restored after (torch's ``no_sync``)."""
    previous = coordinator.grad_sync
    coordinator.grad_sync = False
    try:
        yield
    finally:
        coordinator.grad_sync = previous
