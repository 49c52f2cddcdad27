"""Training checkpoints that survive a crash at any moment, so that ``torchrun --max-restarts=N`` resumes a
DDP or pipeline job where it left off::

    checkpoints = torchpar.checkpoint.Checkpointer("ckpt")          # every rank; a folder all ranks see
    step = checkpoints.latest_step() or 0                            # collective: the same on every rank
    if step:
        state = checkpoints.load(step)                               # this rank's own state
        model.load_state_dict(state["model"]); optimizer.load_state_dict(state["optimizer"])
        torchpar.checkpoint.set_rng_state(state["rng"])
    ...
    checkpoints.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch, "rng": torchpar.checkpoint.rng_state()})   # collective

Each rank writes its own file (a DDP replica, a pipeline rank's stages); rank 0 writes the step's MANIFEST
once every rank's file is on disk, and a step without one does not count. Files are written to a temporary
name, flushed and renamed; the newest ``keep`` complete steps are kept. The C++ engine is
``torchpar::Checkpointer`` (csrc/torchpar/common/checkpointer.h).
"""
from __future__ import annotations

import io
import logging
import os
import random
import sys
from typing import Any

import torch
import torch.distributed as dist

from . import _C

logger = logging.getLogger("torchpar.checkpoint")

__all__ = ["Checkpointer", "rng_state", "set_rng_state"]


class Checkpointer:
    """Step-numbered checkpoints of a job in ``directory`` (the same folder for every rank of ``group``).

    ``control_device`` is where its few bookkeeping collectives run: ``"cpu"``, or a CUDA device for an
    NCCL-only group.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        group: dist.ProcessGroup | None = None,
        keep: int = 2,
        control_device: str | torch.device = "cpu",
    ) -> None:
        group = group if group is not None else dist.distributed_c10d._get_default_group()
        self._engine = _C.Checkpointer(os.fspath(directory), group, keep, str(control_device))
        self._is_rank_0 = dist.get_rank(group) == 0

    @property
    def directory(self) -> str:
        return self._engine.directory

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, the same on every rank, or None. Collective."""
        return self._engine.latest_step()

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Writes this rank's ``state`` (anything ``torch.save`` takes) as checkpoint ``step``. Collective:
        raises on every rank, naming the rank, when any rank could not write; the older steps stay."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self._engine.save_bytes(step, buffer.getvalue())

    def load(self, step: int) -> dict[str, Any]:
        """This rank's state of checkpoint ``step``."""
        state = torch.load(io.BytesIO(self._engine.load_bytes(step)), weights_only=False)
        if self._is_rank_0:
            logger.info("resuming from checkpoint step %d in %s", step, self.directory)
        return state


def rng_state() -> dict[str, Any]:
    """Every random number generator a training loop draws from: torch's CPU and CUDA generators,
    Python's ``random`` and, when numpy is imported, numpy's."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
