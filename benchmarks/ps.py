"""Parameter server: torchpar.ps beside torch.distributed.rpc's parameter-server pattern, and PS training beside DDP.

    python benchmarks/ps.py [--parts updates training] [--configs ...] [--rounds N] [--seconds S]
                            [--train-seconds S] [--rpc-transport uv|tcp|default] [--quick]
                            [--out benchmarks/results]

One world of 3 ranks on this host (one thread each): ranks 0 and 1 are workers, rank 2 the server.
Every rank joins torchpar's Gloo process group (torchpar.init_process_group) and torch.distributed.rpc
(TensorPipe, its own rendezvous on another port), so both implementations run in the same processes.
RPC's TensorPipe agent is limited to its TCP transport (uv) for its messages, the transport Gloo,
and so torchpar.ps, uses too; tensor data still takes TensorPipe's default channel, on one host
cma (process_vm_readv: the receiver copies straight from the sender's memory, one copy, no
socket). TensorPipe's default transports add shared memory, whose reactor thread polls without
sleeping (15-30% of a core per process, measured idle on this 2-core machine): it would slow
torchpar's turns beside it, and in trial runs it did not make the anchor faster here, only more
erratic. `--rpc-transport default` measures with it; `--rpc-transport tcp` sends RPC's tensors
through the socket too (channel "basic"), as Gloo does.

updates   push/pull throughput. The anchor is the RPC parameter-server pattern of pytorch/examples
          (distributed/rpc/parameter_server): one ParameterServer object on the server, created on
          first use and reached through an RRef (`rpc.remote(server, get_parameter_server)`);
          workers call `rpc_sync(ps_rref.owner(), ParameterServer.<fn>, args=(ps_rref, ...))`, and
          the server applies under a lock. torchpar: one ParameterService (consistency "asp").
          Both apply each push at once with plain SGD. Configurations:
            dense N    a float32 table of N values; one update = push a gradient and get the new
                       values back (torchpar: client.push_pull(...).wait(); RPC: apply_and_get,
                       which does table.add_(grad, alpha=-lr) and returns a copy)
            sparse B   a 1M x 32 float32 table; one update = read the rows of a batch of B ids
                       drawn Zipf(1.1) over the rows, then push a gradient for them (torchpar:
                       pull_rows(...).wait() then push_rows(...).wait(); RPC: pull_rows =
                       table.index_select, push_rows = table.index_add_(alpha=-lr) on a dense
                       tensor). torchpar sends each distinct id once, its gradients summed; the
                       RPC side does the same on the worker (torch.unique, index_add_), so both
                       move the same bytes.
          Both workers update at once (the same tensors, the same count); a measurement is the
          slowest worker's time, updates/s the two workers' updates over it. MB/s counts the
          logical payload of an update (dense: gradient in + values out; sparse: the batch's rows
          out + gradients in, 4 bytes a value, ids not counted). After timing, the two servers'
          tables must hold the same values (each received the same pushes; SGD sums commute).
training  the digits MLP of examples/python/train_ddp.py (64-128-10, batch 32 per worker, SGD
          lr 0.1 momentum 0.9, data/digits.pt sharded over the workers, the same batches for
          every variant) trained with torchpar.ps.RemoteParameters on three services (BSP,
          SSP staleness 2, ASP; the server's optimizer is the same SGD) and with
          torchpar.DistributedDataParallel over the two workers (the server rank idles).
          samples/s counts both workers' samples over the slowest worker's time. Every variant
          takes the same number of steps, so the test accuracies at the end compare; BSP applies
          the mean of the workers' gradients each step, as DDP does, so its weights should
          follow DDP's (the difference is reported).

Variants are timed alternately in the same processes over several rounds (the order rotates each
round); a rate is the median over rounds and a ratio the median of the per-round ratios, which
cancels most of the machine's drift. Writes <out>/ps.json and ps.png and prints markdown tables.
The default run takes about two to three minutes on a 2-core machine; --quick is a sanity run.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import math
import os
import pathlib
import statistics
import threading
import time
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn

import targets
from bench_ranks import free_port, run_world, say_whether_pinned

logger = logging.getLogger("torchpar.bench")
WORKERS, SERVERS = 2, 1
WORLD = WORKERS + SERVERS
SERVER_RANK = WORKERS  # torchpar.ps: the last ranks serve
RPC_NAMES = [f"worker{w}" for w in range(WORKERS)] + ["ps"]
IMPLS = ("rpc", "torchpar")
DENSE_SIZES = {"dense 1K": 1 << 10, "dense 64K": 1 << 16, "dense 1M": 1 << 20}
SPARSE_ROWS, SPARSE_DIM, ZIPF_EXPONENT = 1_000_000, 32, 1.1
SPARSE_BATCHES = {"sparse 256": 256, "sparse 4096": 4096}
MICRO_LR = 0.01
GRADIENTS_PER_WORKER = 4  # dense: distinct gradients each worker cycles through
BATCHES_PER_WORKER = 16   # sparse: distinct id batches each worker cycles through
UPDATE_WARMUP = BATCHES_PER_WORKER  # every sparse batch seen (its rows created) before timing
MODES = {"BSP": dict(consistency="bsp"), "SSP s=2": dict(consistency="ssp", staleness=2),
         "ASP": dict(consistency="asp")}
TRAIN_VARIANTS = ("DDP",) + tuple(MODES)
TRAIN_LR, TRAIN_MOMENTUM, TRAIN_BATCH = 0.1, 0.9, 32
TRAIN_WARMUP = 5
DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "digits.pt"
MB = 1e6


# ---------------------------------------------------------------------------------------------------
# The anchor: torch.distributed.rpc's parameter-server pattern (pytorch/examples
# distributed/rpc/parameter_server), ASP: each call applies its gradient at once under the lock.


class ParameterServer:
    """Tables on the server rank; workers reach it through an RRef and call its static methods."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tables: dict[str, torch.Tensor] = {}
        self.lr = MICRO_LR

    @staticmethod
    def create(ps_rref: rpc.RRef, name: str, initial: torch.Tensor) -> None:
        self = ps_rref.local_value()
        with self.lock:
            self.tables[name] = initial.clone()

    @staticmethod
    def create_zeros(ps_rref: rpc.RRef, name: str, rows: int, dim: int) -> None:
        self = ps_rref.local_value()
        with self.lock:
            self.tables[name] = torch.zeros(rows, dim)

    @staticmethod
    def apply_and_get(ps_rref: rpc.RRef, name: str, grad: torch.Tensor) -> torch.Tensor:
        self = ps_rref.local_value()
        with self.lock:
            table = self.tables[name]
            table.add_(grad, alpha=-self.lr)
            return table.clone()  # the reply is serialised after the lock is released

    @staticmethod
    def pull_rows(ps_rref: rpc.RRef, name: str, ids: torch.Tensor) -> torch.Tensor:
        self = ps_rref.local_value()
        with self.lock:
            return self.tables[name].index_select(0, ids)

    @staticmethod
    def push_rows(ps_rref: rpc.RRef, name: str, ids: torch.Tensor, grads: torch.Tensor) -> None:
        self = ps_rref.local_value()
        with self.lock:
            self.tables[name].index_add_(0, ids, grads, alpha=-self.lr)

    @staticmethod
    def values(ps_rref: rpc.RRef, name: str) -> torch.Tensor:
        self = ps_rref.local_value()
        with self.lock:
            return self.tables[name].clone()


_parameter_server: Optional[ParameterServer] = None
_parameter_server_lock = threading.Lock()


def get_parameter_server() -> ParameterServer:
    """Runs on the server (rpc.remote): the one ParameterServer, created on first use."""
    global _parameter_server
    with _parameter_server_lock:
        if _parameter_server is None:
            _parameter_server = ParameterServer()
        return _parameter_server


# ---------------------------------------------------------------------------------------------------
# Push/pull configurations: each has an `update()` per implementation, run the same number of times.


class DenseBench:
    def __init__(self, name: str, numel: int, worker: int, client, ps_rref) -> None:
        import torchpar.ps as ps

        self.name, self.numel = name, numel
        self.bytes_per_update = 2 * numel * 4
        self.description = f"{numel} float32 values; push gradient + pull values"
        generator = torch.Generator().manual_seed(numel)
        initial = torch.randn(numel, generator=generator)
        generator.manual_seed(numel + 1 + worker)
        self.grads = [torch.randn(numel, generator=generator) for _ in range(GRADIENTS_PER_WORKER)]
        self.client, self.ps_rref, self.owner = client, ps_rref, ps_rref.owner()
        self.table = client.dense_table(name, initial, ps.SGD(lr=MICRO_LR))
        if worker == 0:
            rpc.rpc_sync(self.owner, ParameterServer.create, args=(ps_rref, name, initial))
        self.count = {impl: 0 for impl in IMPLS}

    def update(self, impl: str) -> None:
        grad = self.grads[self.count[impl] % len(self.grads)]
        self.count[impl] += 1
        if impl == "torchpar":
            self.client.push_pull([self.table], [grad]).wait()
        else:
            rpc.rpc_sync(self.owner, ParameterServer.apply_and_get, args=(self.ps_rref, self.name, grad))

    def difference(self) -> float:
        """Largest difference between the two servers' tables (both got the same pushes)."""
        ours = self.client.pull([self.table]).wait()[0]
        theirs = rpc.rpc_sync(self.owner, ParameterServer.values, args=(self.ps_rref, self.name))
        return (ours - theirs).abs().max().item()


class SparseBench:
    def __init__(self, name: str, batch: int, worker: int, client, ps_rref, zipf: tuple) -> None:
        import torchpar.ps as ps

        self.name, self.batch = name, batch
        self.bytes_per_update = 2 * batch * SPARSE_DIM * 4
        self.description = (f"{batch} Zipf({ZIPF_EXPONENT}) ids into {SPARSE_ROWS} x {SPARSE_DIM} float32; "
                            "pull rows + push row gradients")
        weights, permutation = zipf
        generator = torch.Generator().manual_seed(batch * 10 + worker)
        self.ids = [permutation[torch.multinomial(weights, batch, replacement=True, generator=generator)]
                    for _ in range(BATCHES_PER_WORKER)]
        self.grads = [torch.randn(batch, SPARSE_DIM, generator=generator) for _ in range(BATCHES_PER_WORKER)]
        self.distinct = statistics.mean(len(ids.unique()) for ids in self.ids)
        self.client, self.ps_rref, self.owner = client, ps_rref, ps_rref.owner()
        self.table = client.sparse_table(name, SPARSE_ROWS, SPARSE_DIM, ps.SGD(lr=MICRO_LR), ps.zeros())
        if worker == 0:
            rpc.rpc_sync(self.owner, ParameterServer.create_zeros, args=(ps_rref, name, SPARSE_ROWS, SPARSE_DIM))
        self.count = {impl: 0 for impl in IMPLS}

    def update(self, impl: str) -> None:
        index = self.count[impl] % len(self.ids)
        self.count[impl] += 1
        ids, grad = self.ids[index], self.grads[index]
        if impl == "torchpar":
            rows = self.client.pull_rows([self.table], [ids]).wait()[0]
            self.client.push_rows([self.table], [ids], [grad]).wait()
        else:
            distinct, inverse = torch.unique(ids, return_inverse=True)
            rows = rpc.rpc_sync(self.owner, ParameterServer.pull_rows,
                                args=(self.ps_rref, self.name, distinct))[inverse]
            summed = torch.zeros(len(distinct), SPARSE_DIM).index_add_(0, inverse, grad)
            rpc.rpc_sync(self.owner, ParameterServer.push_rows, args=(self.ps_rref, self.name, distinct, summed))
        assert rows.shape == (self.batch, SPARSE_DIM)

    def difference(self) -> float:
        ids = torch.cat(self.ids).unique()
        ours = self.client.pull_rows([self.table], [ids]).wait()[0]
        theirs = rpc.rpc_sync(self.owner, ParameterServer.pull_rows, args=(self.ps_rref, self.name, ids))
        return (ours - theirs).abs().max().item()


def zipf_distribution() -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of Zipf(s) over the rows by popularity rank, and which row each rank is (the same everywhere)."""
    weights = torch.arange(1, SPARSE_ROWS + 1, dtype=torch.float64).pow(-ZIPF_EXPONENT)
    return weights, torch.randperm(SPARSE_ROWS, generator=torch.Generator().manual_seed(7))


def timed(run: Callable[[], None], count: int, control) -> float:
    """Seconds the slowest worker takes for `count` calls of `run`."""
    dist.barrier(group=control)
    start = time.perf_counter()
    for _ in range(count):
        run()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=control)
    return elapsed.item()


def measure_updates(worker: int, client, config: dict, control, progress) -> list[dict]:
    ps_rref = rpc.remote(RPC_NAMES[SERVER_RANK], get_parameter_server)
    zipf = zipf_distribution()
    benches = [DenseBench(name, numel, worker, client, ps_rref) for name, numel in DENSE_SIZES.items()
               if name in config["configs"]]
    benches += [SparseBench(name, batch, worker, client, ps_rref, zipf) for name, batch in SPARSE_BATCHES.items()
                if name in config["configs"]]
    dist.barrier(group=control)  # worker 0 created the RPC tables
    counts, seconds = {}, {}
    for bench in benches:
        for impl in IMPLS:
            for _ in range(UPDATE_WARMUP):
                bench.update(impl)
        # A short probe of the anchor sets how many updates fill the target time; torchpar makes the
        # same updates untimed, so both servers see the same pushes.
        probe = timed(lambda: bench.update("rpc"), 5, control)
        for _ in range(5):
            bench.update("torchpar")
        counts[bench.name] = max(5, min(5000, int(config["seconds"] * 5 / probe)))
        seconds[bench.name] = {impl: [] for impl in IMPLS}
    for round_index in range(config["rounds"]):
        shift = round_index % len(benches)
        for bench in benches[shift:] + benches[:shift]:
            for impl in IMPLS if round_index % 2 == 0 else IMPLS[::-1]:
                seconds[bench.name][impl].append(
                    timed(lambda: bench.update(impl), counts[bench.name], control))
                if progress:
                    progress.update()
    dist.barrier(group=control)  # every push is in before the tables are compared
    rows = []
    for bench in benches:
        assert bench.count["rpc"] == bench.count["torchpar"]
        rates = {impl: [WORKERS * counts[bench.name] / s for s in seconds[bench.name][impl]] for impl in IMPLS}
        row = dict(part="updates", config=bench.name, description=bench.description,
                   bytes_per_update=bench.bytes_per_update, updates_per_worker_per_round=counts[bench.name],
                   rounds={impl: rates[impl] for impl in IMPLS},
                   ratio=statistics.median([ours / theirs for ours, theirs in zip(rates["torchpar"], rates["rpc"])]),
                   max_table_difference=bench.difference() if worker == 0 else None)
        for impl in IMPLS:
            row[f"{impl}_updates_per_s"] = statistics.median(rates[impl])
            row[f"{impl}_mb_per_s"] = row[f"{impl}_updates_per_s"] * bench.bytes_per_update / MB
            row[f"{impl}_ms_per_update"] = 1e3 * WORKERS / row[f"{impl}_updates_per_s"]  # per worker
        if isinstance(bench, SparseBench):
            row["mean_distinct_ids"] = bench.distinct
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------
# Training: the digits MLP under RemoteParameters (BSP, SSP, ASP) and under torchpar's DDP.


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


class Trainer:
    """One model copy trained on the worker's shard; every variant sees the same batches in the same order."""

    def __init__(self, name: str, module: nn.Module, batches: list, step: Callable[[torch.Tensor, torch.Tensor], None],
                 before_evaluation: Callable[[], None] = lambda: None) -> None:
        self.name, self.module, self.batches, self._step = name, module, batches, step
        self.before_evaluation = before_evaluation
        self.steps = 0
        self.seconds: list[float] = []

    def step(self) -> None:
        x, y = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        self._step(x, y)


def training_batches(worker: int, data: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = data["train_x"][worker::WORKERS], data["train_y"][worker::WORKERS]
    batches = []
    for epoch in range(8):  # the epochs' shuffles, cycled
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(100 * epoch + worker))
        for start in range(0, len(x) - TRAIN_BATCH + 1, TRAIN_BATCH):
            chosen = order[start:start + TRAIN_BATCH]
            batches.append((x[chosen], y[chosen]))
    return batches


def measure_training(worker: int, services: dict, ddp_group, config: dict, control, progress) -> list[dict]:
    import torchpar
    import torchpar.ps as ps

    data = torch.load(DATA)
    batches = training_batches(worker, data)
    torch.manual_seed(0)
    initial = mlp()  # the same weights for every variant
    loss_fn = nn.CrossEntropyLoss()
    trainers = []

    ddp_module = copy.deepcopy(initial)
    ddp = torchpar.DistributedDataParallel(ddp_module, process_group=ddp_group)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=TRAIN_LR, momentum=TRAIN_MOMENTUM)

    def ddp_step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss_fn(ddp(x), y).backward()
        optimizer.step()

    trainers.append(Trainer("DDP", ddp_module, batches, ddp_step))
    remote = {}
    for mode, service in services.items():
        module = copy.deepcopy(initial)
        remote[mode] = ps.RemoteParameters(module, service.client, ps.SGD(lr=TRAIN_LR, momentum=TRAIN_MOMENTUM))

        def ps_step(x: torch.Tensor, y: torch.Tensor, module=module, params=remote[mode]) -> None:
            loss_fn(module(x), y).backward()  # each gradient is pushed as backward produces it
            params.step()

        trainers.append(Trainer(mode, module, batches, ps_step, remote[mode].pull))
    for trainer in trainers:
        for _ in range(TRAIN_WARMUP):
            trainer.step()
    # Every variant takes the same steps (so the accuracies compare): as many as fill the target time
    # for the slowest one.
    probes = [5 / timed(trainer.step, 5, control) for trainer in trainers]
    count = max(10, min(5000, int(config["train_seconds"] * min(probes))))
    for round_index in range(config["rounds"]):
        shift = round_index % len(trainers)
        order = trainers[shift:] + trainers[:shift]
        for trainer in order if round_index % 2 == 0 else order[::-1]:
            trainer.seconds.append(timed(trainer.step, count, control))
            if progress:
                progress.update()
    dist.barrier(group=control)
    rows = []
    reference = trainers[0]
    for trainer in trainers:
        trainer.before_evaluation()  # PS variants: the servers' final values
        rates = [WORKERS * TRAIN_BATCH * count / s for s in trainer.seconds]
        row = dict(part="training", variant=trainer.name, steps=trainer.steps, steps_per_round=count,
                   samples_per_s=statistics.median(rates), rounds=rates,
                   ratio_to_ddp=statistics.median([r / (WORKERS * TRAIN_BATCH * count / s)
                                                   for r, s in zip(rates, reference.seconds)]))
        with torch.no_grad():
            trainer.module.eval()
            predictions = trainer.module(data["test_x"]).argmax(dim=1)
            row["test_accuracy"] = (predictions == data["test_y"]).float().mean().item()
            row["max_weight_difference_to_ddp"] = max(
                (p - q).abs().max().item() for p, q in zip(trainer.module.parameters(), reference.module.parameters()))
        rows.append(row)
    for params in remote.values():
        params.remove()
    return rows


# ---------------------------------------------------------------------------------------------------


def rank_main(rank: int, world: int, port: int, config: dict, results) -> None:
    import torchpar
    import torchpar.ps as ps

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_flush_denormal(True)
    # rpc.init_rpc's own device-map exchange runs all_gather_object on a bare ProcessGroupGloo.
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    timeout = datetime.timedelta(minutes=5)
    torchpar.init_process_group(backend="gloo", timeout=timeout)
    torch.set_num_threads(1)  # after init_process_group: a pinned rank's share may hold more cores
    workers = list(range(WORKERS))
    control = dist.new_group(workers, backend="gloo")  # timing barriers and maxima, workers only
    ddp_group = dist.new_group(workers, backend="gloo")
    parts = config["parts"]
    service_options = dict(servers=SERVERS, timeout=timeout, stats_interval=1e6)
    # Every rank constructs the services, in the same order (each makes its own process groups).
    services = {}
    if "updates" in parts:
        services["updates"] = ps.ParameterService(consistency="asp", **service_options)
    if "training" in parts:
        for mode, options in MODES.items():
            services[mode] = ps.ParameterService(**options, **service_options)
    if "updates" in parts:
        transports = {"uv": dict(_transports=["uv"]), "tcp": dict(_transports=["uv"], _channels=["basic"]),
                      "default": {}}[config["rpc_transport"]]
        rpc.init_rpc(RPC_NAMES[rank], rank=rank, world_size=world,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                         init_method=f"tcp://127.0.0.1:{config['rpc_port']}", rpc_timeout=300, **transports))
    if rank == SERVER_RANK:
        # Each service's server loop on its own thread (serve() releases the GIL); RPC answers on its own.
        threads = [threading.Thread(target=service.serve, daemon=True) for service in services.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        progress = None
        if rank == 0:
            from tqdm import tqdm

            total = config["rounds"] * ((len(config["configs"]) * len(IMPLS) if "updates" in parts else 0) +
                                        (len(TRAIN_VARIANTS) if "training" in parts else 0))
            progress = tqdm(total=total, desc="ps", unit="run")
        rows = []
        if "updates" in parts:
            rows += measure_updates(rank, services["updates"].client, config, control, progress)
        if "training" in parts:
            rows += measure_training(rank, {mode: services[mode] for mode in MODES}, ddp_group, config, control,
                                     progress)
        if progress:
            progress.close()
        for service in services.values():
            service.finish()
        if rank == 0:
            results.put(rows)
    if "updates" in parts:
        rpc.shutdown()
    for service in services.values():
        service.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# Report


def updates_table(rows: list[dict]) -> str:
    lines = ["| configuration | payload / update | RPC updates/s | torchpar updates/s | RPC MB/s | torchpar MB/s "
             "| RPC ms / update per worker | torchpar ms / update per worker | torchpar/RPC |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["part"] != "updates":
            continue
        payload = r["bytes_per_update"] / MB
        name = r["config"] + (f" ({r['mean_distinct_ids']:.0f} distinct)" if "mean_distinct_ids" in r else "")
        lines.append(f"| {name} | {payload:.3g} MB | {r['rpc_updates_per_s']:.0f} "
                     f"| {r['torchpar_updates_per_s']:.0f} | {r['rpc_mb_per_s']:.1f} | {r['torchpar_mb_per_s']:.1f} "
                     f"| {r['rpc_ms_per_update']:.2f} | {r['torchpar_ms_per_update']:.2f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def training_table(rows: list[dict]) -> str:
    lines = ["| variant | samples/s | ratio to DDP | test accuracy | steps | max abs weight difference to DDP |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["part"] != "training":
            continue
        lines.append(f"| {r['variant']} | {r['samples_per_s']:.0f} | {r['ratio_to_ddp']:.2f} "
                     f"| {100 * r['test_accuracy']:.1f}% | {r['steps']} | {r['max_weight_difference_to_ddp']:.2g} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    updates = [r for r in rows if r["part"] == "updates"]
    training = [r for r in rows if r["part"] == "training"]
    panels = [p for p in (updates, training) if p]
    figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    axes = list(axes[0])
    if updates:
        axis = axes.pop(0)
        width = 0.38
        positions = range(len(updates))
        for offset, impl, label, color in ((-0.5, "rpc", "torch.distributed.rpc PS pattern", "tab:blue"),
                                           (0.5, "torchpar", "torchpar.ps (ASP)", "tab:orange")):
            axis.bar([p + offset * width for p in positions], [r[f"{impl}_updates_per_s"] for r in updates], width,
                     label=label, color=color)
        for p, r in zip(positions, updates):
            axis.text(p, max(r["rpc_updates_per_s"], r["torchpar_updates_per_s"]), f"{r['ratio']:.2f}x",
                      ha="center", va="bottom", fontsize=8)
        axis.set_yscale("log")
        lowest = min(min(r["rpc_updates_per_s"], r["torchpar_updates_per_s"]) for r in updates)
        axis.set_ylim(bottom=10 ** math.floor(math.log10(lowest / 2)))
        axis.set_xticks(list(positions), [r["config"] for r in updates], fontsize=8)
        axis.set(ylabel="updates/s (2 workers, 1 server)",
                 title="Push/pull throughput (label: torchpar/RPC)")
        axis.title.set_fontsize(10)
        axis.legend(fontsize=8)
    if training:
        axis = axes.pop(0)
        colors = ["tab:gray"] + ["tab:orange"] * (len(training) - 1)
        positions = range(len(training))
        axis.bar(positions, [r["samples_per_s"] for r in training], 0.6, color=colors)
        for p, r in zip(positions, training):
            axis.text(p, r["samples_per_s"], f"{r['ratio_to_ddp']:.2f}x\n{100 * r['test_accuracy']:.1f}%",
                      ha="center", va="bottom", fontsize=8)
        axis.set_xticks(list(positions), [("torchpar " if r["variant"] == "DDP" else "PS ") + r["variant"]
                                          for r in training], fontsize=8)
        axis.set(ylabel="training samples/s (2 workers)",
                 title="Digits MLP 64-128-10, batch 32 per worker (label: ratio to DDP, test accuracy)")
        axis.title.set_fontsize(10)
        axis.margins(y=0.2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=["updates", "training"], default=["updates", "training"])
    parser.add_argument("--configs", nargs="+", choices=list(DENSE_SIZES) + list(SPARSE_BATCHES),
                        default=list(DENSE_SIZES) + list(SPARSE_BATCHES), metavar="CONFIG",
                        help="push/pull configurations (default: all of " +
                             ", ".join(repr(c) for c in list(DENSE_SIZES) + list(SPARSE_BATCHES)) + ")")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant (default 7; --quick 2)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="target seconds per timed push/pull run (default 0.4; --quick 0.1)")
    parser.add_argument("--train-seconds", type=float, default=None,
                        help="target seconds per timed run of the slowest training variant (default 1; --quick 0.2)")
    parser.add_argument("--rpc-transport", choices=["uv", "tcp", "default"], default="uv",
                        help="TensorPipe setup of the RPC anchor: uv (TCP messages, default channels: cma for "
                             "tensors; see above), tcp (tensors through the socket too) or TensorPipe's default "
                             "(adds shm, whose reactor thread polls)")
    parser.add_argument("--quick", action="store_true", help="a sanity run of well under a minute")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    say_whether_pinned()
    if "training" in args.parts and not DATA.is_file():
        parser.error(f"{DATA} not found; write it with `python3 scripts/export_digits.py`")
    config = dict(parts=args.parts, configs=args.configs, rounds=args.rounds or (2 if args.quick else 7),
                  seconds=args.seconds or (0.1 if args.quick else 0.4),
                  train_seconds=args.train_seconds or (0.2 if args.quick else 1.0), rpc_port=free_port(),
                  rpc_transport=args.rpc_transport)
    start = time.perf_counter()
    load = os.getloadavg()[0]
    if load > 0.5:
        logger.info("load average %.1f before starting (%d cores): other work on this machine makes timings noisy",
                    load, os.cpu_count())
    rows = run_world(WORLD, rank_main, config)
    config.update(load_average_before=load, load_average_after=os.getloadavg()[0], cores=os.cpu_count(),
                  torch=torch.__version__)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ps.json").write_text(json.dumps(dict(config=config, rows=rows), indent=1))
    plot(rows, args.out / "ps.png")
    report = []
    updates = [r for r in rows if r["part"] == "updates"]
    if updates:
        report.append(updates_table(updates))
        ratios = [r["ratio"] for r in updates]
        report.append(f"torchpar/RPC updates/s: lowest {min(ratios):.2f}, median {statistics.median(ratios):.2f}\n\n"
                      + targets.table([targets.at_least(f"torchpar/RPC, {r['config']}", r["ratio"], 2.0)
                                       for r in updates]))
        worst = max(updates, key=lambda r: r["max_table_difference"])
        if worst["max_table_difference"] > 1e-3:
            report[-1] += (f"\nWARNING {worst['config']}: the two servers' tables differ by up to "
                           f"{worst['max_table_difference']:.3g} after the same pushes")
        else:
            report[-1] += (f"\nafter the same pushes the two servers' tables agree to "
                           f"{worst['max_table_difference']:.1g} (largest absolute difference)")
    training = [r for r in rows if r["part"] == "training"]
    if training:
        report.append(training_table(training))
    logger.info("%s\nwrote %s and %s in %.0f s", "\n\n".join(report), args.out / "ps.json", args.out / "ps.png",
                time.perf_counter() - start)


if __name__ == "__main__":
    main()
