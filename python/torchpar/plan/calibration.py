"""What ``--verify`` teaches the cost model, kept per machine: the C++ engine's calibration store
(``csrc/torchpar/plan/calibration_store.h``), which C++ programs planning with ``plan_on_ranks`` read too. Every
verified configuration is a sample; the calibration is ``fit_calibration`` over the samples of this torch version,
backend, world size and thread count, across runs and models, so one noisy run does not decide it.

Kept in ``$TORCHPAR_PLAN_CALIBRATION``, else ``$XDG_CACHE_HOME/torchpar/plan_calibration.pt`` (by default
``~/.cache/torchpar/plan_calibration.pt``), read when used: the test suite points both elsewhere.
"""
from __future__ import annotations

import pathlib
from typing import Optional, Sequence

from torchpar._C import plan as _engine

Calibration = _engine.Calibration
BOUNDS = _engine.calibration_bounds()  # each knob's (lowest, highest), as fit_calibration searches it
FIELDS = tuple(BOUNDS)
CalibrationStore = _engine.CalibrationStore
default_calibration = _engine.default_calibration
describe = _engine.describe_calibration


def calibration_file() -> pathlib.Path:
    """Where --verify keeps what it learned on this machine."""
    return pathlib.Path(_engine.calibration_file())


def _store(path: Optional[pathlib.Path]) -> CalibrationStore:
    return CalibrationStore(None if path is None else str(path))


def load_calibration(world: int, backend: str, path: Optional[pathlib.Path] = None) -> Optional[Calibration]:
    """What earlier --verify runs on this machine taught for this world and backend, if any."""
    return _store(path).calibration(world, backend)


def _link(cost) -> list:
    return [cost.alpha_ms, cost.ms_per_byte]


def network_fields(network) -> dict:
    """A NetworkProfile's measured links as JSON fields, [α ms, β ms per byte] each (stage_transfer and
    ddp_all_reduce only where the pipeline's transfers and DDP's buckets do not go through the group)."""
    return {name: _link(getattr(network, name))
            for name in ("all_reduce", "send_recv", "copy", "all_gather", "reduce_scatter", "stage_transfer",
                         "ddp_all_reduce")
            if getattr(network, name) is not None}


_CONFIGURATION_FIELDS = ("world", "replicas", "tensor", "schedule", "microbatches", "virtual_stages", "balance",
                         "servers", "synchronous", "zero_stage")


def configuration_fields(configuration) -> dict:
    """A Configuration as JSON fields."""
    return dict(strategy=configuration.strategy.name,
                **{field: getattr(configuration, field) for field in _CONFIGURATION_FIELDS})


def configuration_from_fields(fields: dict):
    """A Configuration from its JSON fields (those missing, from samples kept before they existed, keep their
    defaults)."""
    configuration = _engine.Configuration()
    configuration.strategy = getattr(_engine.Strategy, fields["strategy"])
    for name in _CONFIGURATION_FIELDS:
        if name in fields:
            setattr(configuration, name, fields[name])
    return configuration


def calibration_fields(calibration: Calibration) -> dict:
    """A Calibration as JSON fields."""
    return {field: getattr(calibration, field) for field in FIELDS}


def copy_calibration(calibration: Calibration) -> Calibration:
    copied = Calibration()
    for field in FIELDS:
        setattr(copied, field, getattr(calibration, field))
    return copied


def learn(samples: Sequence, world: int, backend: str, path: Optional[pathlib.Path] = None,
          start: Optional[Calibration] = None) -> tuple[Calibration, int]:
    """Adds `samples` (CalibrationSample) to those kept for this world and backend, fits the calibration to
    all of them from `start` (the default one), keeps both; returns the calibration and how many samples it
    rests on."""
    return _store(path).learn(list(samples), world, backend, start or default_calibration(world))
