"""What ``--verify`` teaches the cost model, kept per machine: every verified configuration (the profile and
network measurements its prediction came from, and its measured step time) is a sample; the calibration is
the C++ ``fit_calibration`` over the samples of this torch version, backend, world size and thread count,
across runs and models, so one noisy run does not decide it.

Kept in ``$TORCHPAR_PLAN_CALIBRATION``, else ``$XDG_CACHE_HOME/torchpar/plan_calibration.json`` (by default
``~/.cache/torchpar/plan_calibration.json``), read when used: the test suite points both elsewhere.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Optional, Sequence

import torch

from torchpar._C import plan as _engine

Calibration = _engine.Calibration
BOUNDS = _engine.calibration_bounds()  # each knob's (lowest, highest), as fit_calibration searches it
FIELDS = tuple(BOUNDS)


def calibration_file() -> pathlib.Path:
    """Where --verify keeps what it learned on this machine."""
    if os.environ.get("TORCHPAR_PLAN_CALIBRATION"):
        return pathlib.Path(os.environ["TORCHPAR_PLAN_CALIBRATION"])
    cache = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(cache) / "torchpar" / "plan_calibration.json"

KEPT_SAMPLES = 60  # the most recent per key: the machine may change under it

_LAYER_FIELDS = ("name", "forward_ms", "backward_input_ms", "backward_weight_ms", "forward_overhead_ms",
                 "backward_input_overhead_ms", "backward_weight_overhead_ms", "parameter_bytes", "activation_bytes",
                 "input_bytes", "output_bytes", "sparse_parameter_bytes", "sparse_bytes_per_sample", "in_features",
                 "out_features", "elementwise")
_CONFIGURATION_FIELDS = ("world", "replicas", "tensor", "schedule", "microbatches", "virtual_stages", "balance",
                         "servers", "synchronous", "zero_stage")


def default_calibration(world: int) -> Calibration:
    """Before any --verify: gradient communication hidden behind backward only when every rank has a core to
    spare for its communication thread (2 x world cores; in between, in proportion). The engines' host times
    stay at zero here; ``host_overhead.measure_host_overheads`` measures them on the ranks at hand."""
    calibration = Calibration()
    calibration.overlap = min(1.0, max(0.0, (os.cpu_count() or 1) / world - 1))
    return calibration


def describe(calibration: Calibration) -> str:
    return (f"compute x {calibration.compute_scale:.2f}, communication x {calibration.communication_scale:.2f}, "
            f"{100 * calibration.overlap:.0f}% of communication "
            f"overlapped, {calibration.per_action_ms:.2f} ms per pipeline action, {calibration.per_transfer_ms:.2f} "
            f"ms per transfer, {calibration.per_step_ms:.2f} ms per step, parameter server "
            f"+{calibration.ps_ms_per_byte * 2**20:.2f} ms/MiB, +{calibration.ps_per_step_ms:.2f} ms per step and "
            f"+{calibration.ps_rows_ms:.2f} ms per step of sparse rows")


# Samples of version 1 were measured with glibc trimming freed memory (before the planner kept it): their steps
# ran up to 2x slower, by how much depending on what the process had allocated before. Those of version 2 hold
# networks probed by plain means, which a few stalls of the machine moved up to 10x.
SAMPLES_VERSION = 3


def _key(world: int, backend: str) -> str:
    return f"{torch.__version__}/{backend}/{world} ranks/{torch.get_num_threads()} threads/v{SAMPLES_VERSION}"


def _read(path: pathlib.Path) -> dict:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _calibration_from(fields: dict) -> Calibration:
    calibration = Calibration()
    for field in FIELDS:
        if field in fields:  # a file from before a field existed keeps that field's default
            setattr(calibration, field, fields[field])
    return calibration


def load_calibration(world: int, backend: str, path: Optional[pathlib.Path] = None) -> Optional[Calibration]:
    """What earlier --verify runs on this machine taught for this world and backend, if any."""
    entry = _read(path or calibration_file()).get(_key(world, backend))
    return _calibration_from(entry["calibration"]) if isinstance(entry, dict) and "calibration" in entry else None


def _link(cost) -> list:
    return [cost.alpha_ms, cost.ms_per_byte]


def _link_from(values) -> object:
    cost = _engine.LinkCost()
    cost.alpha_ms, cost.ms_per_byte = values
    return cost


def network_fields(network) -> dict:
    """A NetworkProfile's measured links as JSON fields, [α ms, β ms per byte] each (stage_transfer and
    ddp_all_reduce only where the pipeline's transfers and DDP's buckets do not go through the group)."""
    return {name: _link(getattr(network, name))
            for name in ("all_reduce", "send_recv", "copy", "all_gather", "reduce_scatter", "stage_transfer",
                         "ddp_all_reduce")
            if getattr(network, name) is not None}


def sample_to_json(sample) -> dict:
    configuration = sample.configuration
    return dict(
        measured_ms=sample.measured_ms,
        batch=sample.model.batch,
        contention=sample.model.contention,
        layers=[{field: getattr(layer, field) for field in _LAYER_FIELDS} for layer in sample.model.layers],
        network=network_fields(sample.network),
        ddp_in_place=sample.network.ddp_in_place,
        ps_ring_bytes=sample.network.ps_ring_bytes,
        setup=dict(batch=sample.setup.batch, optimizer_state_factor=sample.setup.optimizer_state_factor,
                   optimizer_ms_per_byte=sample.setup.optimizer_ms_per_byte),
        configuration=configuration_fields(configuration))


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
    return _calibration_from(calibration_fields(calibration))


def sample_from_json(fields: dict):
    sample = _engine.CalibrationSample()
    model = _engine.ModelProfile()
    model.batch = fields["batch"]
    model.contention = fields["contention"]
    layers = []
    for values in fields["layers"]:
        layer = _engine.LayerProfile()
        # Samples kept before input_bytes existed counted a layer's activations as its input plus its output.
        values.setdefault("input_bytes", values["activation_bytes"] - values["output_bytes"])
        values.setdefault("elementwise", False)  # samples kept before tensor parallelism ran activations split
        for name in _LAYER_FIELDS:
            setattr(layer, name, values[name])
        layers.append(layer)
    model.layers = layers
    sample.model = model
    network = _engine.NetworkProfile()
    # Samples kept before the pipeline's rings existed have no stage_transfer: their pipelines sent through
    # the group (send_recv); before DDP's same-host group, no ddp_all_reduce (all_reduce).
    for name, values in fields["network"].items():
        setattr(network, name, _link_from(values))
    # Samples kept before the rings existed measured the parameter server through Gloo alone.
    network.ps_ring_bytes = fields.get("ps_ring_bytes", 0)
    # Samples kept before DDP averaged gradients in place measured it copying them into its buckets and back.
    network.ddp_in_place = fields.get("ddp_in_place", False)
    sample.network = network
    setup = _engine.TrainingSetup()
    for name, value in fields["setup"].items():
        setattr(setup, name, value)
    sample.setup = setup
    sample.configuration = configuration_from_fields(fields["configuration"])
    sample.measured_ms = fields["measured_ms"]
    return sample


def learn(samples: Sequence, world: int, backend: str, path: Optional[pathlib.Path] = None,
          start: Optional[Calibration] = None) -> tuple[Calibration, int]:
    """Adds `samples` (CalibrationSample) to those kept for this world and backend, fits the calibration to
    all of them from `start` (the default one), keeps both; returns the calibration and how many samples it
    rests on."""
    path = path or calibration_file()
    saved = _read(path)
    key = _key(world, backend)
    entry = saved.get(key) if isinstance(saved.get(key), dict) else {}
    kept = []
    for fields in entry.get("samples", []):
        try:
            kept.append(sample_from_json(fields))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # written by an older version: its successors will do
    kept = (kept + list(samples))[-KEPT_SAMPLES:]
    calibration = _engine.fit_calibration(kept, start or default_calibration(world))
    saved[key] = dict(calibration=calibration_fields(calibration),
                      samples=[sample_to_json(sample) for sample in kept])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved))
    return calibration, len(kept)
