"""Runs a planned configuration for real for a few steps on the ranks at hand and measures its step time.

Every rank of the world calls :func:`measure_step_ms` with the same configuration; it returns the slowest
rank's median step time (for the parameter server: the slowest worker's).
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import torchpar
import torchpar.pipeline
import torchpar.ps
from torchpar._C import plan as _engine
from torchpar.plan.model import Model


def _timed_steps(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _slowest(value: float, group) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor)


def _ddp(model: Model, layers: list[nn.Module], batch: int, warmup: int, steps: int) -> float:
    world = dist.get_world_size()
    net = torchpar.DistributedDataParallel(nn.Sequential(*layers))
    optimizer = model.make_optimizer(net.parameters())
    x, y = model.sample(batch // world)

    def step():
        optimizer.zero_grad()
        model.loss(net(x), y).backward()
        optimizer.step()

    return _timed_steps(step, warmup, steps)


def _pipeline(model: Model, configuration, batch: int, warmup: int, steps: int, backend: str) -> float:
    world = dist.get_world_size()
    replicas = configuration.replicas
    grid = torchpar.ParallelGrid(data=replicas, pipeline=world // replicas, backend=backend)
    pipe = torchpar.pipeline.Pipeline(
        [lambda i=i: copy.deepcopy(model.build(i)) for i in range(len(model.layers))], model.loss,
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
        net = nn.Sequential(*[copy.deepcopy(model.build(i)) for i in range(len(model.layers))])
        optimizer = (torchpar.ps.Adam(lr=model.lr) if model.optimizer == "adam"
                     else torchpar.ps.SGD(lr=model.lr, momentum=0.9))
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


def measure_step_ms(model: Model, configuration, batch: int, backend: str, control, warmup: int = 2,
                    steps: int = 5) -> float:
    """The slowest rank's median step time of `configuration` in milliseconds (collective over the world;
    `control` is a Gloo group of every rank for the timing's reduction)."""
    strategy = configuration.strategy
    dist.barrier(group=control)
    if strategy == _engine.Strategy.ddp:
        layers = [copy.deepcopy(model.build(i)) for i in range(len(model.layers))]
        mine = _ddp(model, layers, batch, warmup, steps)
    elif strategy == _engine.Strategy.pipeline:
        mine = _pipeline(model, configuration, batch, warmup, steps, backend)
    else:
        mine = _parameter_server(model, configuration, batch, warmup, steps)
    return _slowest(mine, control)
