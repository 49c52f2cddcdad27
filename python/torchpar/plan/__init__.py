"""Which strategy fits this model on these ranks: profile it, predict every strategy's step time and memory,
rank them, and (``verify``) run the best for real.

    python -m torchpar.plan --model torchpar.plan.examples:deep_mlp --batch 64 --world 4 --memory-per-rank 8MiB

From Python::

    profile, optimizer_ms_per_byte = torchpar.plan.profile(model, batch=16)      # one process
    network = torchpar.plan.measure_network(group)                               # every rank
    result = torchpar.plan.plan(model, profile, network, batch=64, world=4, optimizer_ms_per_byte=...)
    print(torchpar.plan.render_table(result)); print(result.recommended_python)
    memory = torchpar.plan.predict_memory(model, profile, configuration, batch=64)   # one configuration's peak

The cost model and the search are C++ (``torchpar::plan``, the same from LibTorch programs); see
docs/planner.md for what each prediction counts.
"""
from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from torchpar._C import plan as _engine
from torchpar._C import pipeline as _pipeline_engine
from torchpar.same_host import shm_group_beside
from torchpar.plan.calibration import Calibration, default_calibration, learn as learn_calibration, load_calibration
from torchpar.plan.embeddings import sparse_able
from torchpar.plan.model import OPTIMIZER_STATE, Model, load_model
from torchpar.plan.tensor_split import elementwise, splittable_linear

__all__ = ["Calibration", "Configuration", "Model", "NetworkProfile", "Strategy", "calibration_sample",
           "default_calibration", "learn_calibration", "load_calibration", "load_model", "measure_heap_retention",
           "measure_model_pass", "measure_network", "plan", "predict_memory", "predict_step_ms", "profile",
           "render_table"]

render_table = _engine.render_table
Configuration = _engine.Configuration
NetworkProfile = _engine.NetworkProfile
Strategy = _engine.Strategy


def _layer_traits(module: torch.nn.Module):
    """What the engine's planner can do with the layer (C++ ``layer_from_module`` finds the same in LibTorch
    modules): the Linear a tensor group can split, whether it acts element by element, the embedding tables a
    parameter server can hold as rows."""
    traits = _pipeline_engine.LayerTraits()
    linear = splittable_linear(module)
    if linear is not None:
        traits.split_in_features, traits.split_out_features = linear.in_features, linear.out_features
    traits.elementwise = elementwise(module)
    tables = [m for m in module.modules() if sparse_able(m)]
    if tables:
        traits.embedding_bytes = sum(m.weight.nbytes for m in tables)
        traits.embedding_row_bytes = max(m.weight[0].nbytes for m in tables)
    return traits


def _engine_model(model: Model, batch: int):
    """The model as the C++ engine takes it: a factory of a fresh pipeline layer per layer, with its traits, and a
    batch of inputs."""
    from torchpar.pipeline import _as_tensors, _layer

    def build(index: int):
        module = copy.deepcopy(model.build(index))
        layer = _layer(str(index), module)
        layer.traits = _layer_traits(module)
        return layer

    inputs, _ = model.sample(batch)
    return [lambda i=i: build(i) for i in range(len(model.layers))], _as_tensors(inputs)


def profile(model: Model, batch: int, repeats: int = 5):
    """Each layer's forward, backward (input and weight parts), parameter, activation and output bytes at
    `batch` samples (and its backward's temporaries, where CPU allocations are counted), the first layer's
    embedding tables (which a parameter server can hold as sparse rows), the Linear layers a tensor group can
    split, and the optimizer's time per parameter byte: (ModelProfile, ms per byte). The heap's retention in the
    model's training is :func:`measure_heap_retention`'s, set apart (the planner's probes profile too)."""
    factories, inputs = _engine_model(model, batch)
    return _engine.profile_layers(factories, inputs, repeats, OPTIMIZER_STATE[model.optimizer])


_RETENTION_STEPS = 20


def measure_heap_retention(model: Model, batch: int) -> int:
    """What the heap keeps resident beyond the tensors' peak while this process trains the whole model on `batch`
    samples for 20 steps (its optimizer): under torchpar.keep_freed_memory its small blocks and the pages the block
    cache rounds up to. The second of two runs, the first paying what a process sets up once. 0 where CPU
    allocations are not counted (torchpar.allocator) or /proc does not tell."""
    from torch import nn

    from torchpar import allocator
    from torchpar.plan.verify import resident_kib, start_memory_watch

    if not allocator.counting_cpu_allocations():
        return 0
    kept = 0
    for _ in range(2):
        baseline = start_memory_watch()
        allocator.reset_cpu_peak_memory()
        before = allocator.cpu_memory_allocated()
        net = nn.Sequential(*[copy.deepcopy(model.build(i)) for i in range(len(model.layers))])
        optimizer = model.make_optimizer(net.parameters())
        x, y = model.sample(batch)
        for _ in range(_RETENTION_STEPS):
            optimizer.zero_grad()
            model.loss(net(x), y).backward()
            optimizer.step()
        peak = resident_kib("VmHWM")
        if baseline is None or peak is None:
            return 0
        kept = (peak - baseline) * 1024 - (allocator.cpu_max_memory_allocated() - before)
        del net, optimizer
    return max(0, kept)


def measure_model_pass(model: Model, batch: int, group: Optional[dist.ProcessGroup] = None):
    """The whole model's forward and backward at `batch` samples: ~0.1 s of passes on rank 0 alone, then on every
    rank of `group` at once, three rounds alternated (every rank calls it): ``.alone_ms``, ``.together_ms``,
    the medians."""
    factories, inputs = _engine_model(model, batch)
    return _engine.measure_model_pass(factories, inputs, group if group is not None else dist.group.WORLD)


def measure_network(group: Optional[dist.ProcessGroup] = None,
                    sizes_bytes: Sequence[int] = (4 << 10, 64 << 10, 256 << 10, 4 << 20), repeats: int = 25):
    """α + β · bytes of all-reduce, all-gather, reduce-scatter and a transfer between two ranks over `group`,
    and of a memory copy on every rank at once (every rank calls it); and of DDP's bucket all-reduce where it
    goes through a same-host shm group beside `group` (``ddp_all_reduce``); whether DDP averages gradients
    in place there (``ddp_in_place``: on shm)."""
    group = group if group is not None else dist.group.WORLD
    network = _engine.measure_network(group, list(sizes_bytes), repeats)
    data_group = shm_group_beside(group, torch.device("cpu"))
    if data_group is not None:
        network.ddp_all_reduce = _engine.measure_network(data_group, list(sizes_bytes), repeats).all_reduce
    network.ddp_in_place = data_group is not None or dist.get_backend(group) == "shm"
    network.reduce_scatter_clones_input = data_group is None and dist.get_backend(group) == "gloo"
    if network.ddp_in_place:  # DDP's buckets, and the sharded engine's collectives, go through an shm segment
        network.host_memory.shm_chunk_bytes = _engine.SHM_CHUNK_BYTES
    return network


def plan(model: Model, model_profile, network, *, batch: int, world: int, memory_per_rank: int = 0,
         optimizer_ms_per_byte: float = 0.0, calibration: Optional[Calibration] = None,
         microbatches: Sequence[int] = (1, 2, 4, 8, 16)):
    """Every configuration of `world` ranks, predicted, ranked; the excluded ones with their reasons."""
    return _engine.plan(model_profile, network, _setup(model, batch, optimizer_ms_per_byte),
                        calibration or Calibration(), world, memory_per_rank, list(microbatches))


def calibration_sample(model: Model, model_profile, network, configuration, *, batch: int,
                       optimizer_ms_per_byte: float, measured_ms: float):
    """One verified configuration, for :func:`learn_calibration`."""
    sample = _engine.CalibrationSample()
    sample.model, sample.network, sample.configuration = model_profile, network, configuration
    sample.setup = _setup(model, batch, optimizer_ms_per_byte)
    sample.measured_ms = measured_ms
    return sample


def _setup(model: Model, batch: int, optimizer_ms_per_byte: float):
    setup = _engine.TrainingSetup()
    setup.batch = batch
    setup.optimizer_state_factor = OPTIMIZER_STATE[model.optimizer]
    setup.optimizer_ms_per_byte = optimizer_ms_per_byte
    return setup


def predict_memory(model: Model, model_profile, configuration, *, batch: int, network=None):
    """What the fullest rank of `configuration` holds, line by line, at `batch` samples per step (all ranks): a
    ``MemoryBreakdown`` whose ``tensor_bytes`` is the allocator's peak (``torchpar.allocator``) and whose ``render()``
    prints the lines. The tensors need no timings: `network` (a ``NetworkProfile``, e.g. from
    :func:`measure_network`) only says how the collectives go; by default through shared memory, as beside a Gloo
    group of one host. The resident set's lines of shared memory and the host come from a measured one."""
    return _engine.predict(model_profile, network if network is not None else _engine.NetworkProfile(),
                           _setup(model, batch, 0.0), configuration, Calibration()).memory


def predict_step_ms(model: Model, model_profile, network, configuration, *, batch: int,
                    optimizer_ms_per_byte: float, calibration: Optional[Calibration] = None) -> float:
    return _engine.predict(model_profile, network, _setup(model, batch, optimizer_ms_per_byte), configuration,
                           calibration or Calibration()).step_ms
