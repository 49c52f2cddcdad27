"""Which strategy fits this model on these ranks: profile it, predict every strategy's step time and memory,
rank them, and (``verify``) run the best for real.

    python -m torchpar.plan --model torchpar.plan.examples:deep_mlp --batch 64 --world 4 --memory-per-rank 8MiB

From Python::

    profile, optimizer_ms_per_byte = torchpar.plan.profile(model, batch=16)      # one process
    network = torchpar.plan.measure_network(group)                               # every rank
    result = torchpar.plan.plan(model, profile, network, batch=64, world=4, optimizer_ms_per_byte=...)
    print(torchpar.plan.render_table(result)); print(result.recommended_python)

The cost model and the search are C++ (``torchpar::plan``, the same from LibTorch programs); see
docs/planner.md for what each prediction counts.
"""
from __future__ import annotations

import copy
import json
import os
import pathlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from torchpar._C import plan as _engine
from torchpar.plan.model import OPTIMIZER_STATE, Model, load_model

__all__ = ["Calibration", "Model", "calibrate", "default_calibration", "load_calibration", "load_model", "measure_network", "plan",
           "predict_step_ms", "profile", "render_table", "save_calibration"]

Calibration = _engine.Calibration
render_table = _engine.render_table
CALIBRATION_FIELDS = ("compute_scale", "per_action_ms", "per_transfer_ms", "per_step_ms")
CALIBRATION_FILE = pathlib.Path(os.environ.get("TORCHPAR_PLAN_CALIBRATION",
                                               pathlib.Path.home() / ".cache" / "torchpar" / "plan_calibration.json"))


def profile(model: Model, batch: int, repeats: int = 5):
    """Each layer's forward, backward (input and weight parts), parameter, activation and output bytes at
    `batch` samples, and the optimizer's time per parameter byte: (ModelProfile, ms per byte)."""
    from torchpar.pipeline import _as_tensors, _layer

    inputs, _ = model.sample(batch)
    factories = [lambda i=i: _layer(str(i), copy.deepcopy(model.build(i))) for i in range(len(model.layers))]
    return _engine.profile_layers(factories, _as_tensors(inputs), repeats)


def measure_network(group: Optional[dist.ProcessGroup] = None,
                    sizes_bytes: Sequence[int] = (4 << 10, 256 << 10, 4 << 20), repeats: int = 5):
    """α + β · bytes of all-reduce and of a transfer between two ranks over `group` (every rank calls it)."""
    return _engine.measure_network(group if group is not None else dist.group.WORLD, list(sizes_bytes), repeats)


def plan(model: Model, model_profile, network, *, batch: int, world: int, memory_per_rank: int = 0,
         optimizer_ms_per_byte: float = 0.0, calibration: Optional[Calibration] = None,
         microbatches: Sequence[int] = (1, 2, 4, 8, 16)):
    """Every configuration of `world` ranks, predicted, ranked; the excluded ones with their reasons."""
    return _engine.plan(model_profile, network, _setup(model, batch, optimizer_ms_per_byte),
                        calibration or Calibration(), world, memory_per_rank, list(microbatches))


def calibrate(model: Model, model_profile, network, *, batch: int, optimizer_ms_per_byte: float,
              configurations, measured_ms: Sequence[float]) -> Calibration:
    """What the measured runs teach the cost model (C++ ``fit_calibration``): how much slower the ranks
    compute together, and the host time per pipeline action, per transfer and per step."""
    return _engine.fit_calibration(model_profile, network, _setup(model, batch, optimizer_ms_per_byte),
                                   list(configurations), list(measured_ms))


def _setup(model: Model, batch: int, optimizer_ms_per_byte: float):
    setup = _engine.TrainingSetup()
    setup.batch = batch
    setup.optimizer_state_factor = OPTIMIZER_STATE[model.optimizer]
    setup.optimizer_ms_per_byte = optimizer_ms_per_byte
    return setup


def predict_step_ms(model: Model, model_profile, network, configuration, *, batch: int,
                    optimizer_ms_per_byte: float, calibration: Optional[Calibration] = None) -> float:
    return _engine.predict(model_profile, network, _setup(model, batch, optimizer_ms_per_byte), configuration,
                           calibration or Calibration()).step_ms


def default_calibration(world: int) -> Calibration:
    """Before any --verify: ranks that outnumber this machine's cores share them, so each computes
    world / cores times slower."""
    calibration = Calibration()
    calibration.compute_scale = max(1.0, world / (os.cpu_count() or 1))
    return calibration


def _calibration_key(world: int, backend: str) -> str:
    return f"{torch.__version__}/{backend}/{world} ranks/{torch.get_num_threads()} threads"


def load_calibration(world: int, backend: str, path: pathlib.Path = CALIBRATION_FILE) -> Optional[Calibration]:
    """What an earlier --verify on this machine learned for this world and backend, if any."""
    try:
        saved = json.loads(path.read_text())[_calibration_key(world, backend)]
    except (OSError, ValueError, KeyError):
        return None
    calibration = Calibration()
    for field in CALIBRATION_FIELDS:
        setattr(calibration, field, saved[field])
    return calibration


def save_calibration(calibration: Calibration, world: int, backend: str, path: pathlib.Path = CALIBRATION_FILE):
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    saved[_calibration_key(world, backend)] = {field: getattr(calibration, field) for field in CALIBRATION_FIELDS}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=1))
