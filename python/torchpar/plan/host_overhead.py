"""What the engines cost on these ranks beyond compute and idle-network transfers, measured before any --verify:
collectives while ranks compute, host time per pipeline action, and per parameter-server step, byte and step of
sparse rows.

A pipeline's action (a micro-batch's forward or backward on a stage) costs host work: posting its transfers, the
schedule's bookkeeping, waking the rank that waits for it; a parameter server's step costs its round trips'
requests, wake-ups and bookkeeping; and DDP's all-reduces, run while the ranks compute, cost more than the probes
of an idle process group said (4 ranks on 2 cores: 1.6-1.8x). Measured here (2 cores): 0.3-1.0 ms per action,
0-2.7 ms per step and 0.2-2 ms/MiB, where the deep MLP's layers compute in ~0.5 ms each. The cost model without
them predicted pipelines 40-60% fast, the parameter server 20-60% and 4-rank DDP 44% until --verify taught it.
So the planner runs DDP, a pipeline and parameter servers of small layers for real, and takes as the default
those values under which the cost model reproduces their steps.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from torchpar._C import plan as _engine
from torchpar.plan.calibration import BOUNDS, configuration_from_fields, copy_calibration
from torchpar.plan.model import Model

_MICROBATCHES = 4
_SAMPLES = 4  # per micro-batch, or per parameter-server worker
_DATA_PARALLEL_SAMPLES = 16  # per rank
# Steps of a few milliseconds each: the median of 20 after 3 (the process's first pipeline, its setup not yet
# paid) read a pipeline probe 4.8-8.7 and 4.9-10.8 ms in six runs in a row, of 60 after 10, 4.6-5.8 and 5.1-8.3.
_PROBE_STEPS = 60
_DATA_PARALLEL_PROBE_STEPS = 20  # of ~10-40 ms
_SAME_HOST_VARIABLE = "TORCHPAR_DDP_SAME_HOST"


def _linear_model(layers: int, width: int) -> Model:
    return Model(layers=[nn.Linear(width, width) for _ in range(layers)],
                 sample=lambda batch: (torch.randn(batch, width), torch.randn(batch, width)),
                 loss=nn.functional.mse_loss)


def _embedding_model(rows: int, dim: int, ids_per_sample: int) -> Model:
    return Model(layers=[nn.EmbeddingBag(rows, dim, mode="mean"), nn.Linear(dim, dim)],
                 sample=lambda batch: (torch.randint(0, rows, (batch, ids_per_sample)), torch.randn(batch, dim)),
                 loss=nn.functional.mse_loss, optimizer="adam")


@contextlib.contextmanager
def _ddp_through_the_group():
    """DDP made inside keeps its buckets on the process group (TORCHPAR_DDP_SAME_HOST=0, ddp.md)."""
    before = os.environ.get(_SAME_HOST_VARIABLE)
    os.environ[_SAME_HOST_VARIABLE] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[_SAME_HOST_VARIABLE]
        else:
            os.environ[_SAME_HOST_VARIABLE] = before


def _through_the_group(network):
    """`network` with DDP's buckets costed at the group's all-reduce."""
    group_only = _engine.NetworkProfile()
    for name in ("all_reduce", "send_recv", "copy", "all_gather", "reduce_scatter", "stage_transfer", "ps_ring_bytes"):
        setattr(group_only, name, getattr(network, name))
    group_only.ddp_in_place = network.ddp_in_place and network.ddp_all_reduce is None  # the group is shm itself
    return group_only


def _solve(predicted_ms: Callable[[float], float], measured_ms: float, largest: float) -> float:
    """The value in [0, largest] at which the (growing) prediction meets the measurement: bisection."""
    low, high = 0.0, largest
    if predicted_ms(low) >= measured_ms:
        return low
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if predicted_ms(middle) < measured_ms else (low, middle)
    return low


def _fitted(model: Model, fields: dict, batch: int, network, calibration, knob: str, control, backend: str,
            samples: list, steps: int = _PROBE_STEPS) -> float:
    """(Every rank; the answer on rank 0.) `fields` run for real on `model` (the median of `steps` steps after a
    sixth as many), then the value of the calibration's `knob`, within the range fit_calibration searches, under
    which the cost model predicts the step measured; the run joins `samples` (rank 0)."""
    from torchpar.plan import calibration_sample, profile
    from torchpar.plan.verify import measure

    configuration = configuration_from_fields(fields)
    measured_ms = measure(model, configuration, batch, backend, control, warmup=steps // 6, steps=steps).step_ms
    if dist.get_rank() != 0:
        return 0.0
    model_profile, optimizer_ms_per_byte = profile(model, batch // dist.get_world_size())
    sample = calibration_sample(model, model_profile, network, configuration, batch=batch,
                                optimizer_ms_per_byte=optimizer_ms_per_byte, measured_ms=measured_ms)
    samples.append(sample)
    setup = sample.setup
    trial = copy_calibration(calibration)
    lowest, highest = BOUNDS[knob]

    def predicted_ms(above_lowest: float) -> float:
        setattr(trial, knob, lowest + above_lowest)
        return _engine.predict(model_profile, network, setup, configuration, trial).step_ms

    return lowest + _solve(predicted_ms, measured_ms, highest - lowest)


def measure_process_overhead(network, control, backend: str) -> int:
    """(Every rank.) How much a rank's resident set grows beyond its tensors' peak and the pages the memory model
    knows of (memory_model.h: the shm segment, the heap's retention) — its threads' stacks and arenas, the groups'
    buffers — in DDP of two Linear(256, 256) at 16 samples a rank: its second run (the first pays what a process
    sets up once, which --verify leaves out too). 0 where the allocator's count is off or /proc does not tell."""
    from torchpar import allocator
    from torchpar.plan import profile
    from torchpar.plan.verify import measure

    world = dist.get_world_size()
    if world < 2 or not allocator.counting_cpu_allocations():
        return 0
    model = _linear_model(2, 256)
    configuration = configuration_from_fields(dict(strategy="ddp", world=world, replicas=1, tensor=1, schedule="1f1b",
                                                   microbatches=1, virtual_stages=1, balance=[], servers=0,
                                                   synchronous=True, zero_stage=1))
    batch = world * _DATA_PARALLEL_SAMPLES
    for _ in range(2):
        measured = measure(model, configuration, batch, backend, control, warmup=2, steps=8)
    if measured.memory_bytes == 0:
        return 0
    model_profile, _ = profile(model, _DATA_PARALLEL_SAMPLES)
    setup = _engine.TrainingSetup()
    setup.batch = batch
    predicted = _engine.predict(model_profile, network, setup, configuration)
    known = predicted.memory_per_rank - predicted.tensor_memory_per_rank - network.host_memory.process_overhead_bytes
    return max(0, measured.memory_bytes - measured.allocated_bytes - known)


def measure_host_overheads(calibration, network, control, backend: str) -> list:
    """(Every rank; what counts is rank 0's.) Sets, in this order (each fitted with those before it):
    `calibration.communication_scale` from DDP of four Linear(512, 512); `per_action_ms` from a 1F1B pipeline of
    one Linear(8, 8) per rank and 4 micro-batches; `ps_per_step_ms` and `ps_ms_per_byte` from parameter servers
    (half the ranks serving, BSP) of two Linear(8, 8), then of two Linear(512, 512); `ps_rows_ms` from one of a
    4096 x 8 embedding (8 ids per sample) under a Linear(8, 8), whatever the model (a calibration learned from
    these runs applies to later plans of any model). Returns those runs as calibration samples (rank 0): with
    them, --verify's fit tells a parameter server's cost per step from its cost per byte, which one model's runs
    alone barely can."""
    samples = []
    world = dist.get_world_size()
    if world < 2:
        return samples  # none runs on one rank
    common = dict(world=world, replicas=1, tensor=1, schedule="1f1b", microbatches=_MICROBATCHES, virtual_stages=1,
                  balance=[], servers=0, synchronous=True)
    # Collectives cost more while the ranks compute (and, with more ranks than cores, wait for the scheduler)
    # than the probes of an otherwise idle process group measured. The scale is the group's: the probe's DDP
    # all-reduces through the group itself, not through the same-host shm group it would take beside Gloo,
    # whose all-reduce is too cheap to tell a scale from (fitted to it, the scale ran into its bound of 4 and
    # tensor parallelism's all-reduces on Gloo were predicted 1.5-2x too slow).
    with _ddp_through_the_group():
        calibration.communication_scale = _fitted(_linear_model(4, 512), dict(common, strategy="ddp"),
                                                  world * _DATA_PARALLEL_SAMPLES, _through_the_group(network),
                                                  calibration, "communication_scale", control, backend, samples,
                                                  steps=_DATA_PARALLEL_PROBE_STEPS)
    calibration.per_action_ms = _fitted(_linear_model(world, 8), dict(common, strategy="pipeline",
                                                                      balance=[1] * world),
                                        _MICROBATCHES * _SAMPLES, network, calibration, "per_action_ms", control,
                                        backend, samples)
    # The parameter server's host time per step from tiny tables, then per byte (of its round trips) from 2 MiB.
    servers = world // 2
    parameter_server = dict(common, strategy="ps", servers=servers)
    batch = (world - servers) * _SAMPLES
    calibration.ps_per_step_ms = _fitted(_linear_model(2, 8), parameter_server, batch, network, calibration,
                                         "ps_per_step_ms", control, backend, samples)
    calibration.ps_ms_per_byte = _fitted(_linear_model(2, 512), parameter_server, batch, network, calibration,
                                         "ps_ms_per_byte", control, backend, samples)
    # Sparse rows are pulled before forward and pushed after backward, round trips of their own.
    calibration.ps_rows_ms = _fitted(_embedding_model(4096, 8, 8), parameter_server, batch, network, calibration,
                                     "ps_rows_ms", control, backend, samples)
    return samples
