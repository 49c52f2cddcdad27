"""The engines' host time on these ranks, measured before any --verify: per pipeline action, and per parameter-server
step and byte.

Besides compute and the bytes it moves, a pipeline's action (a micro-batch's forward or backward on a stage)
costs host work: posting its transfers, the schedule's bookkeeping, waking the rank that waits for it; and a
parameter server's step costs its round trips' requests, wake-ups and bookkeeping. Measured here (2 cores):
0.3-0.8 ms per action, 0.2-2.7 ms per step and 0.6-2 ms/MiB, where the deep MLP's layers compute in ~0.5 ms each.
The cost model fed with compute and transfer costs alone predicted pipelines 40-60% fast and the parameter server
20-60% fast until --verify taught it. So the planner runs a pipeline and a parameter server of tiny layers for
real, and takes as the default host times those under which the cost model reproduces their steps.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from torchpar._C import plan as _engine
from torchpar.plan.calibration import configuration_from_fields, copy_calibration
from torchpar.plan.model import Model

_MICROBATCHES = 4
_SAMPLES = 4  # per micro-batch, or per parameter-server worker


def _linear_model(layers: int, width: int) -> Model:
    return Model(layers=[nn.Linear(width, width) for _ in range(layers)],
                 sample=lambda batch: (torch.randn(batch, width), torch.randn(batch, width)),
                 loss=nn.functional.mse_loss)


def _solve(predicted_ms: Callable[[float], float], measured_ms: float, largest: float) -> float:
    """The value in [0, largest] at which the (growing) prediction meets the measurement: bisection."""
    low, high = 0.0, largest
    if predicted_ms(low) >= measured_ms:
        return low
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if predicted_ms(middle) < measured_ms else (low, middle)
    return low


def _fitted(model: Model, fields: dict, batch: int, network, calibration, knob: str, largest: float, control,
            backend: str) -> float:
    """(Every rank; the answer on rank 0.) `fields` run for real on `model`, then the value of the calibration's
    `knob` under which the cost model predicts the step measured."""
    from torchpar.plan import _setup, profile
    from torchpar.plan.verify import measure

    configuration = configuration_from_fields(fields)
    measured_ms = measure(model, configuration, batch, backend, control, warmup=3, steps=10).step_ms
    if dist.get_rank() != 0:
        return 0.0
    model_profile, optimizer_ms_per_byte = profile(model, batch // dist.get_world_size())
    setup = _setup(model, batch, optimizer_ms_per_byte)
    trial = copy_calibration(calibration)

    def predicted_ms(value: float) -> float:
        setattr(trial, knob, value)
        return _engine.predict(model_profile, network, setup, configuration, trial).step_ms

    return _solve(predicted_ms, measured_ms, largest)


def measure_host_overheads(calibration, network, control, backend: str) -> None:
    """(Every rank; what counts is rank 0's.) Sets `calibration.per_action_ms` from a 1F1B pipeline of one
    Linear(8, 8) per rank and 4 micro-batches, and `calibration.ps_per_step_ms` and `ps_ms_per_byte` from parameter
    servers (half the ranks serving, BSP) of two Linear(8, 8) and then of two Linear(512, 512)."""
    world = dist.get_world_size()
    if world < 2:
        return  # neither runs on one rank
    # Each knob's bound is fit_calibration's (cost_model.cpp).
    common = dict(world=world, replicas=1, tensor=1, schedule="1f1b", microbatches=_MICROBATCHES, virtual_stages=1,
                  balance=[], servers=0, synchronous=True)
    calibration.per_action_ms = _fitted(_linear_model(world, 8), dict(common, strategy="pipeline",
                                                                      balance=[1] * world),
                                        _MICROBATCHES * _SAMPLES, network, calibration, "per_action_ms", 2.0,
                                        control, backend)
    # The parameter server's host time per step from tiny tables, then per byte (of its round trips) from 2 MiB.
    servers = world // 2
    parameter_server = dict(common, strategy="ps", servers=servers)
    batch = (world - servers) * _SAMPLES
    calibration.ps_per_step_ms = _fitted(_linear_model(2, 8), parameter_server, batch, network, calibration,
                                         "ps_per_step_ms", 20.0, control, backend)
    calibration.ps_ms_per_byte = _fitted(_linear_model(2, 512), parameter_server, batch, network, calibration,
                                         "ps_ms_per_byte", 2.0 / 2**20, control, backend)
