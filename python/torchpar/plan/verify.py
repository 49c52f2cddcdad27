"""Runs a planned configuration for real for a few steps on the ranks at hand and measures its step time and
memory.

Every rank of the world calls :func:`measure` with the same configuration; it returns the slowest rank's median
step time (for the parameter server: the slowest worker's) and the fullest rank's memory: how far its resident
set grew above where it stood before the configuration was built (Linux; freed memory is handed back to the
system first, so what an earlier configuration left does not hide this one's).
"""
from __future__ import annotations

import copy
import ctypes
import ctypes.util
import pathlib
import re
import statistics
import time
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

import torchpar
import torchpar.pipeline
from torchpar import allocator
import torchpar.ps
from torchpar._C import plan as _engine
from torchpar.plan.embeddings import build_with_remote_embeddings
from torchpar.plan.model import Model
from torchpar.plan.tensor_split import split_layer, split_model


def _timed_steps(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _largest(value: float, group) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor)


_STATUS = pathlib.Path("/proc/self/status")


def resident_kib(field: str) -> Optional[int]:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match[1]) if match else None


def start_memory_watch() -> Optional[int]:
    """Hands freed memory back to the system (the heap's and the block cache's, torchpar.allocator), resets the
    resident set's high-water mark and returns the resident set now (KiB), or None where Linux's /proc does not
    tell."""
    allocator.release_freed_memory()
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        try:
            ctypes.CDLL(libc_name).malloc_trim(0)
        except (OSError, AttributeError):
            pass
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    except OSError:
        return None
    return resident_kib("VmRSS")


class Measurement(NamedTuple):
    step_ms: float          # the slowest rank's median step
    memory_bytes: int       # the fullest rank's growth of its resident set (0 where it cannot be measured)
    allocated_bytes: int = 0  # the fullest rank's peak of CPU tensor memory above where it stood before (0: not counted)


def _timed_training(model: Model, net: nn.Module, samples: int, warmup: int, steps: int,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> float:
    """The median step of `net` trained by `optimizer` (by default the model's over `net`'s parameters) on
    `samples` samples per rank."""
    optimizer = optimizer or model.make_optimizer(net.parameters())
    x, y = model.sample(samples)

    def step():
        optimizer.zero_grad()
        model.loss(net(x), y).backward()
        optimizer.step()

    return _timed_steps(step, warmup, steps)


def _ddp(model: Model, layers: list[nn.Module], batch: int, warmup: int, steps: int) -> float:
    net = torchpar.DistributedDataParallel(nn.Sequential(*layers))
    return _timed_training(model, net, batch // dist.get_world_size(), warmup, steps)


def _sharded(model: Model, layers: list[nn.Module], stage: int, batch: int, warmup: int, steps: int) -> float:
    """ZeRO at `stage`, each layer a unit at stage 3 (as the cost model counts), the model's optimizer on the
    rank's shard."""
    net = torchpar.ShardedDataParallel(nn.Sequential(*layers), stage=stage)
    optimizer_class, defaults = model.optimizer_class()
    return _timed_training(model, net, batch // dist.get_world_size(), warmup, steps,
                           torchpar.ShardedOptimizer(net, optimizer_class, **defaults))


def _pipeline(model: Model, configuration, batch: int, warmup: int, steps: int, backend: str,
              tensor_roles: Optional[list[str]]) -> float:
    world = dist.get_world_size()
    replicas, tensor = configuration.replicas, configuration.tensor
    grid = torchpar.ParallelGrid(data=replicas, pipeline=world // (replicas * tensor), tensor=tensor, backend=backend)
    roles = tensor_roles if tensor > 1 else ["whole"] * len(model.layers)
    # A tensor group's ranks build their split layers from the same draws (rank 0 alone profiled the model).
    torch.manual_seed(0)
    pipe = torchpar.pipeline.Pipeline(
        [lambda i=i: split_layer(model.build(i), roles[i], grid.tensor_group) for i in range(len(model.layers))],
        model.loss,
        schedule=configuration.schedule, microbatches=configuration.microbatches,
        virtual_stages=configuration.virtual_stages, balance=list(configuration.balance),
        process_group=grid.pipeline_group, data_parallel_group=grid.data_group if replicas > 1 else None)
    optimizer = model.make_optimizer(pipe.parameters())
    x, y = model.sample(batch // replicas)

    def step():
        optimizer.zero_grad()
        pipe.step(x, y)
        optimizer.step()

    return _timed_steps(step, warmup, steps)


def _parameter_server(model: Model, configuration, batch: int, warmup: int, steps: int) -> float:
    workers = dist.get_world_size() - configuration.servers
    service = torchpar.ps.ParameterService(servers=configuration.servers,
                                           consistency="bsp" if configuration.synchronous else "asp")
    milliseconds = 0.0
    if service.is_server:
        service.serve()
    else:
        optimizer = (torchpar.ps.Adam(lr=model.lr) if model.optimizer == "adam"
                     else torchpar.ps.SGD(lr=model.lr, momentum=0.9))
        # The first layer's embeddings as sparse tables on the servers, as the cost model counts them (sparse rows
        # take SGD without momentum).
        rows_optimizer = optimizer if model.optimizer == "adam" else torchpar.ps.SGD(lr=model.lr)
        first = build_with_remote_embeddings(model, 0, service.client, rows_optimizer, "embedding")
        # A row exists on its server once some batch touched it: every row once first, so that the servers hold what
        # a long training makes them hold (as predicted), not the few a short verification reaches.
        with torch.no_grad():
            for table in first.modules():
                if isinstance(table, torchpar.ps.Embedding):
                    for start in range(0, table.num_rows, 1024):
                        table(torch.arange(start, min(start + 1024, table.num_rows)))
        net = nn.Sequential(first, *[copy.deepcopy(model.build(i)) for i in range(1, len(model.layers))])
        parameters = torchpar.ps.RemoteParameters(net, service.client, optimizer)
        x, y = model.sample(batch // workers)

        def step():
            model.loss(net(x), y).backward()
            parameters.step()

        milliseconds = _timed_steps(step, warmup, steps)
        del parameters
        service.finish()
    del service
    return milliseconds


def _tensor_parallel(model: Model, roles: list[str], configuration, batch: int, warmup: int, steps: int,
                     backend: str) -> float:
    replicas = configuration.replicas
    grid = torchpar.ParallelGrid(data=replicas, tensor=dist.get_world_size() // replicas, backend=backend)
    torch.manual_seed(0)  # the split layers from the same draws on every rank (rank 0 alone profiled the model)
    net = split_model([model.build(i) for i in range(len(model.layers))], roles, grid.tensor_group)
    if replicas > 1:  # the replicas' gradients averaged over the data group
        net = torchpar.DistributedDataParallel(net, process_group=grid.data_group)
    return _timed_training(model, net, batch // replicas, warmup, steps)


def measure(model: Model, configuration, batch: int, backend: str, control, warmup: int = 2, steps: int = 5,
            tensor_roles: Optional[list[str]] = None) -> Measurement:
    """`configuration` run for `warmup` + `steps` steps (collective over the world; `control` is a Gloo group of
    every rank for the reductions; `tensor_roles`: each layer's under tensor parallelism, as
    ``torchpar._C.plan.tensor_parallel_roles`` gives them for the configuration)."""
    strategy = configuration.strategy
    dist.barrier(group=control)
    baseline = start_memory_watch()
    counting = allocator.counting_cpu_allocations()
    if counting:
        allocator.reset_cpu_peak_memory()
        allocated_before = allocator.cpu_memory_allocated()
    if strategy == _engine.Strategy.ddp:
        layers = [copy.deepcopy(model.build(i)) for i in range(len(model.layers))]
        mine = _ddp(model, layers, batch, warmup, steps)
    elif strategy == _engine.Strategy.pipeline:
        mine = _pipeline(model, configuration, batch, warmup, steps, backend, tensor_roles)
    elif strategy == _engine.Strategy.sharded:
        layers = [copy.deepcopy(model.build(i)) for i in range(len(model.layers))]
        mine = _sharded(model, layers, configuration.zero_stage, batch, warmup, steps)
    elif strategy == _engine.Strategy.tensor:
        mine = _tensor_parallel(model, tensor_roles, configuration, batch, warmup, steps, backend)
    else:
        mine = _parameter_server(model, configuration, batch, warmup, steps)
    peak = resident_kib("VmHWM")
    grown = (peak - baseline) * 1024 if baseline is not None and peak is not None else 0
    allocated = allocator.cpu_max_memory_allocated() - allocated_before if counting else 0
    return Measurement(_largest(mine, control), int(_largest(grown, control)), int(_largest(allocated, control)))
