"""Pipeline parallelism: torchpar's Pipeline beside torch.distributed.pipelining, same model, cut and schedule.

    python benchmarks/pipeline.py [--worlds 2 4] [--schedules gpipe 1f1b interleaved zero_bubble]
                                  [--microbatches 4 8] [--quick] [--out benchmarks/results]

For each world size the script spawns that many ranks on this host (one thread each) in one Gloo
world. The model is a deep MLP: 16 x (Linear(512, 512) + ReLU), batch 64, MSE loss against a
random target. For every (schedule, micro-batches) every rank builds, from the same initial weights:

    torchpar   torchpar.pipeline.Pipeline(model, mse_loss, schedule=..., microbatches=m,
               virtual_stages=v, loss_on="last") on its own Gloo group
    torch      torch.distributed.pipelining: a PipelineStage per virtual stage this rank holds (stage
               indices rank, rank + world, ...), each the same nn.Sequential slice torchpar cut
               (pipe.balance), driven by ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B (v=2)
               or, for zero_bubble (torchpar's ZB-H1), ScheduleInterleavedZeroBubble with one stage
               per rank: with one local stage its action order is ZB-H1's (checked below, see
               `same_order`), on its own Gloo group

Both compute the same gradients: torch's loss is mse/m with scale_grads=False, torchpar scales each
micro-batch's loss by 1/m; neither returns outputs (torch: return_outputs=False; torchpar:
loss_on="last", no loss broadcast). A step is forward + backward of the batch, no optimizer (the
gradients accumulate, the same in both). One difference in how: torchpar runs each plain nn.Linear as
its own linear layer, whose backward adds the weight gradient into .grad in one addmm_ where autograd
computes it into a new tensor and adds that (torchpar/pipeline/linear_layer.h). Before timing, one
step of each from zero gradients must give the same gradients on every rank; for the torch
schedules that run a stored order (interleaved, zero bubble) that order is compared with torchpar's
action list (`same_order`).

Throughput: after warm-up, torch and torchpar are timed alternately in the same processes over
several rounds (the one going first alternates); a measurement is the slowest rank's time for a
fixed number of steps. samples/s is the median over rounds, torchpar/torch the median of the
per-round ratios.

Bubble (world sizes with a core per rank; 4 ranks on this 2-core machine are oversubscribed, so
idle time there is time spent waiting for a core, not pipeline bubble): each rank measures, one
rank at a time, its own stages alone on one micro-batch (forward F, backward B, and for zero_bubble
the input-gradient I and weight-gradient W passes done as torchpar does, layer by layer), once with
the layers as torchpar builds them and once as the plain modules torch runs. torchpar's stage costs
feed torchpar.pipeline.simulate(schedule, ranks, m, v, F, B, I, W): its bubble_fraction is the
prediction; the measured bubble is 1 - (compute per rank) / (step time), compute per rank =
m x (F + B) (or F + I + W) summed over the rank's stages, each engine's own costs. A second measured
figure uses each rank's main-thread CPU time over the timed steps as busy time (Gloo waits sleep):
it counts the runtime's own work and any slowdown of compute inside the pipeline as busy. The
prediction is made twice: with transfers free (the schedule's own bubble, the closed forms) and with
the measured transfer time (half the round trip of one micro-batch's activation between ranks 0
and 1, the receive posted ahead as the runtime posts it) as the delay from each send to its data.

Peak memory (every configuration; tabled for m=8 on 2 ranks): one step of each under (a)
torch.autograd.graph.saved_tensors_hooks counting the bytes of the tensors autograd saves for
backward that are alive (parameters excluded; a tensor saved twice counted once; released when
autograd drops it), the peak per rank; and (b) torch.profiler's CPU memory events, the peak of the
net bytes allocated since the step began on the rank's main thread (all tensors: saved activations,
tensors a runtime holds itself such as zero-bubble's per-layer outputs and output gradients or sent
activations kept until the step ends, receive buffers, temporaries). The simulator's peak_activations (stage x micro-batch activations alive per rank)
times the saved bytes of one stage's forward on one micro-batch (measured alone) is the prediction.

Writes <out>/pipeline.json and pipeline.png (throughput; bubble predicted vs measured; peak memory)
and prints the tables. The default run takes about two minutes on an otherwise idle 2-core
machine; --quick (m=8 only, fewer and shorter rounds) under a minute.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import logging
import os
import pathlib
import statistics
import time
import warnings
import weakref
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import targets
from bench_ranks import run_world, say_whether_pinned

logger = logging.getLogger("torchpar.bench")
VIRTUAL_STAGES = {"interleaved": 2}
TORCH_SCHEDULES = {  # torch.distributed.pipelining class for each torchpar schedule
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
}
IMPLS = ("torch", "torchpar")
LAYER_PAIRS, WIDTH, BATCH = 16, 512, 64
MODEL_DESCRIPTION = f"{LAYER_PAIRS} x (Linear({WIDTH},{WIDTH}) + ReLU), batch {BATCH}, MSE"
WARMUP_STEPS = 3
MEMORY_MICROBATCHES = 8  # the memory table's configurations (all are measured)
GRADIENT_RTOL = 1e-4
MB = 2**20


def build_model() -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(LAYER_PAIRS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def boundaries_of(balance: list[int]) -> list[int]:
    bounds = [0]
    for count in balance:
        bounds.append(bounds[-1] + count)
    return bounds


# ---------------------------------------------------------------------------------------------------
# Memory probes


class SavedActivations:
    """Bytes of the tensors autograd saves for backward that are alive now, and their peak.

    Use as a context manager around a step. A saved tensor is counted from when autograd saves it
    until autograd drops it (the packed holder's finalizer); one tensor saved by two nodes (a ReLU's
    output, the next Linear's input) counts once; parameters (a Linear saves its weight) not at all.
    """

    class _Held:
        __slots__ = ("tensor", "__weakref__")

        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        self.excluded = {p.data_ptr() for p in parameters}
        self.alive: dict[tuple[int, int], int] = {}  # (data_ptr, bytes) -> holders alive
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        if tensor.data_ptr() in self.excluded or tensor.numel() == 0:
            return tensor
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if key not in self.alive:
            self.alive[key] = 0
            self.live += key[1]
            self.peak = max(self.peak, self.live)
        self.alive[key] += 1
        # Detached: an output saved with its grad_fn would keep its own node alive (a cycle through
        # autograd that only backward without retain_graph breaks); autograd restores grad_fn on unpack.
        held = self._Held(tensor.detach())
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, SavedActivations._Held) else packed

    def _release(self, key: tuple[int, int]) -> None:
        self.alive[key] -= 1
        if not self.alive[key]:
            del self.alive[key]
            self.live -= key[1]

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


@contextlib.contextmanager
def stderr_silenced() -> Iterator[None]:
    """Kineto writes profiler start/stop lines (and a note that there is no GPU) to fd 2."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_allocated(step: Callable[[], None]) -> int:
    """Peak of the net bytes allocated on the CPU since `step` began (torch.profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


# ---------------------------------------------------------------------------------------------------
# One stage alone: the costs the simulator needs


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def stage_costs(stage: nn.Sequential, first: bool, last: bool, m: int, split: bool, repeats: int, impl: str) -> dict:
    """This stage alone on one micro-batch: F, B (full backward), and with `split` I and W as
    torchpar's zero-bubble stage does them (a leaf at every layer boundary; I walks the layers back
    for input gradients keeping the graph; W then backpropagates each layer to its weights). For
    `impl` "torchpar" each layer runs as torchpar's pipeline builds it (plain nn.Linear layers as its
    own linear layer, which adds weight gradients into .grad in one step), for "torch" as the module."""
    generator = torch.Generator().manual_seed(7)
    rows = BATCH // m
    x = torch.randn(rows, WIDTH, generator=generator).requires_grad_(not first)
    target = torch.randn(rows, WIDTH, generator=generator)
    grad = torch.randn(rows, WIDTH, generator=generator)
    import torchpar.pipeline

    parameters = list(stage.parameters())
    engine_layers = [torchpar.pipeline._layer(str(index), layer) for index, layer in enumerate(stage)]
    calls = [(lambda t, layer=layer: layer([t])[0]) for layer in engine_layers] if impl == "torchpar" else list(stage)

    def forward(layer_by_layer: bool):
        inputs, outputs, current = [], [], x
        for call in calls:
            if layer_by_layer and inputs:
                current = current.detach().requires_grad_(True)
            inputs.append(current)
            current = call(current)
            outputs.append(current)
        if last:
            loss_input = current.detach().requires_grad_(True) if layer_by_layer else current
            return inputs, outputs, loss_input, F.mse_loss(loss_input, target) / m
        return inputs, outputs, None, None

    times: dict[str, list[float]] = {"forward": [], "backward": [], "backward_input": [], "backward_weight": []}
    for repeat in range(3 + repeats):
        timed = repeat >= 3
        start = time.perf_counter()
        _, outputs, _, loss = forward(False)
        middle = time.perf_counter()
        if last:
            loss.backward()
        else:
            outputs[-1].backward(grad)
        end = time.perf_counter()
        if timed:
            times["forward"].append(middle - start)
            times["backward"].append(end - middle)
        if not split:
            continue
        inputs, outputs, loss_input, loss = forward(True)
        start = time.perf_counter()
        gradient = torch.autograd.grad(loss, loss_input, retain_graph=True)[0] if last else grad
        output_gradients = [None] * len(stage)
        for index in reversed(range(len(stage))):
            output_gradients[index] = gradient
            if inputs[index].requires_grad:
                gradient = torch.autograd.grad(outputs[index], inputs[index], gradient, retain_graph=True)[0]
        middle = time.perf_counter()
        for index, layer in enumerate(stage):
            weights = [p for p in layer.parameters() if p.requires_grad]
            if weights:
                torch.autograd.backward(outputs[index], output_gradients[index], inputs=weights)
        end = time.perf_counter()
        if timed:
            times["backward_input"].append(middle - start)
            times["backward_weight"].append(end - middle)
    with SavedActivations(parameters) as saved:
        _, outputs, _, loss = forward(False)
    unit_bytes = saved.peak
    del outputs, loss
    for p in parameters:
        p.grad = None
    x.grad = None
    return {name: median_ms(samples) if samples else None for name, samples in times.items()} | {
        "activation_bytes": unit_bytes}


# ---------------------------------------------------------------------------------------------------
# One configuration on every rank


class Config:
    """torch's and torchpar's pipelines for one (schedule, micro-batches) on this rank."""

    def __init__(self, schedule: str, m: int, groups: dict) -> None:
        import torch.distributed.pipelining as pipelining

        from torchpar.pipeline import Pipeline

        self.schedule, self.m, self.v = schedule, m, VIRTUAL_STAGES.get(schedule, 1)
        self.groups = groups
        torch.manual_seed(0)
        initial = build_model()  # the same weights on every rank and for both
        self.pipe = Pipeline(copy.deepcopy(initial), F.mse_loss, microbatches=m, schedule=schedule,
                             virtual_stages=self.v, process_group=groups["torchpar"], loss_on="last")
        bounds = boundaries_of(self.pipe.balance)
        reference = copy.deepcopy(initial)
        self.stage_indices = list(self.pipe.stages)
        self.submodules = [nn.Sequential(*[reference[i] for i in range(bounds[s], bounds[s + 1])])
                           for s in self.stage_indices]
        stages = [pipelining.PipelineStage(sub, s, len(self.pipe.balance), torch.device("cpu"), group=groups["torch"])
                  for sub, s in zip(self.submodules, self.stage_indices)]
        schedule_class = getattr(pipelining, TORCH_SCHEDULES[schedule])
        loss_fn = lambda output, target: F.mse_loss(output, target) / m  # noqa: E731 - torchpar's 1/m scaling
        if len(stages) == 1 and schedule in ("gpipe", "1f1b"):
            self.torch_schedule = schedule_class(stages[0], m, loss_fn=loss_fn, scale_grads=False)
        else:
            self.torch_schedule = schedule_class(stages, m, loss_fn=loss_fn, scale_grads=False)
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(BATCH, WIDTH, generator=generator)
        self.y = torch.randn(BATCH, WIDTH, generator=generator)
        self.first, self.last = self.pipe.is_first_stage, self.pipe.is_last_stage
        self.parameters = {"torch": [p for sub in self.submodules for p in sub.parameters()],
                           "torchpar": list(self.pipe.parameters())}
        self.steps = 0
        self.rates: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        self.cpu_ms: dict[str, list[float]] = {impl: [] for impl in IMPLS}  # per step, this rank

    def same_order(self) -> bool | None:
        """Whether torch's compute actions on this rank are torchpar's, in order (None: torch's
        single-stage schedules execute their own loop, not a stored order, so there is none to compare)."""
        if self.schedule in ("gpipe", "1f1b"):
            return None
        rank = self.pipe.stages[0] % len(self.pipe.balance)
        theirs = [(a.computation_type.value, a.stage_index, a.microbatch_index)
                  for a in self.torch_schedule.pipeline_order[rank] if a is not None
                  and a.computation_type.value in ("F", "B", "I", "W")]
        ours = [(a.type.name, a.stage, a.microbatch) for a in self.pipe.actions if a.type.name in ("F", "B", "I", "W")]
        return theirs == ours

    def step(self, impl: str) -> None:
        if impl == "torchpar":
            self.pipe.step(self.x if self.first else None, self.y if self.last else None)
        else:
            self.torch_schedule.step(*((self.x,) if self.first else ()), target=self.y if self.last else None,
                                     return_outputs=False)

    def zero_grad(self) -> None:
        for parameters in self.parameters.values():
            for p in parameters:
                p.grad = None

    def gradient_difference(self) -> float:
        """One step of each from zero gradients; the largest relative difference of their gradients."""
        self.zero_grad()
        for impl in IMPLS:
            self.step(impl)
        theirs = torch.cat([p.grad.reshape(-1) for p in self.parameters["torch"]])
        ours = torch.cat([p.grad.reshape(-1) for p in self.parameters["torchpar"]])
        return ((theirs - ours).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()


def timed_run(config: Config, impl: str, control) -> tuple[float, float]:
    """(slowest rank's wall seconds, this rank's main-thread CPU seconds) for config.steps steps."""
    dist.barrier(group=control)
    start, cpu_start = time.perf_counter(), time.thread_time()
    for _ in range(config.steps):
        config.step(impl)
    cpu = time.thread_time() - cpu_start
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=control)
    return elapsed.item(), cpu


def measure_costs(config: Config, rank: int, world: int, control, repeats: int, impl: str) -> list[dict]:
    """Every stage's isolated costs as `impl` computes them, one rank at a time (the others wait), gathered on
    every rank."""
    mine = []
    for turn in range(world):
        if turn == rank:
            for sub, index in zip(config.submodules, config.stage_indices):
                mine.append(stage_costs(sub, index == 0, index == len(config.pipe.balance) - 1, config.m,
                                        split=config.schedule == "zero_bubble", repeats=repeats, impl=impl)
                            | {"stage": index, "rank": rank})
        dist.barrier(group=control)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=control)
    return sorted((cost for costs in gathered for cost in costs), key=lambda cost: cost["stage"])


def measure_transfer(config: Config, rank: int, control, repeats: int = 30) -> float:
    """Milliseconds from a send of one micro-batch's activation to its arrival, its receive posted
    ahead as the runtime posts it: half the median round trip between ranks 0 and 1, on every rank."""
    group = config.groups["torchpar"]
    activation = torch.randn(BATCH // config.m, WIDTH)
    round_trips = []
    if rank < 2:
        peer = 1 - rank
        for _ in range(repeats + 3):
            start = time.perf_counter()
            if rank == 0:
                back = dist.irecv(torch.empty_like(activation), src=peer, group=group)
                dist.send(activation, dst=peer, group=group)
                back.wait()
            else:
                dist.recv(torch.empty_like(activation), src=peer, group=group)
                dist.send(activation, dst=peer, group=group)
            round_trips.append(time.perf_counter() - start)
    one_way = [statistics.median(round_trips[3:]) / 2 * 1e3 if rank == 0 else 0.0]
    dist.broadcast_object_list(one_way, src=0, group=control)
    return one_way[0]


def measure_run_bubble(config: Config, world: int, control, steps: int = 5) -> dict:
    """The bubble as torchpar's own timeline records it (pipe.last_step_timeline): per step, the
    ranks start together (barrier) and the bubble is 1 - compute of all ranks / (ranks x the slowest
    rank's step). Also each stage's mean measured duration per action type, for the simulator, and
    each rank's host work per compute action: its step less its compute and its waiting for
    transfers (pipe.last_step_waiting_milliseconds), over its compute actions."""
    per_step = []
    for _ in range(steps):
        dist.barrier(group=control)
        config.step("torchpar")
        timeline = [(str(t.action.type).rsplit(".", 1)[-1], t.action.stage, t.end - t.start)
                    for t in config.pipe.last_step_timeline]
        per_step.append((timeline, config.pipe.last_step_milliseconds, config.pipe.last_step_waiting_milliseconds))
    gathered = gather(per_step, world, control)
    bubbles, durations, host = [], {}, {rank: [] for rank in range(world)}
    for step in range(steps):
        makespan = max(gathered[rank][step][1] for rank in range(world))
        busy = sum(ms for rank in range(world) for _, _, ms in gathered[rank][step][0])
        bubbles.append(1 - busy / (world * makespan))
        for rank in range(world):
            timeline, step_ms, waiting_ms = gathered[rank][step]
            for kind, stage, ms in timeline:
                durations.setdefault(stage, {}).setdefault(kind, []).append(ms)
            host[rank].append(max(0.0, step_ms - waiting_ms - sum(ms for _, _, ms in timeline)) / len(timeline))
    stage_ms = [{kind: statistics.mean(values) for kind, values in durations[stage].items()}
                for stage in sorted(durations)]
    return {"measured": statistics.median(bubbles), "stage_ms": stage_ms,
            "host_ms_per_action": [statistics.median(host[rank]) for rank in range(world)]}


def measure_memory(config: Config) -> dict:
    """This rank's peaks for one step of each: saved activations and all allocations (bytes)."""
    result = {}
    for impl in IMPLS:
        gc.collect()
        with SavedActivations(config.parameters[impl]) as saved:
            config.step(impl)
        gc.collect()
        result[f"{impl}_saved_bytes"] = saved.peak
        result[f"{impl}_leftover_saved_bytes"] = saved.live  # all should be released by the step's end
        result[f"{impl}_allocated_bytes"] = peak_allocated(lambda: config.step(impl))
    return result


def gather(value, world: int, control) -> list:
    gathered: list = [None] * world
    dist.all_gather_object(gathered, value, group=control)
    return gathered


def rank_main(rank: int, world: int, port: int, options: dict, results) -> None:
    import torchpar
    from torchpar.pipeline import simulate

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_flush_denormal(True)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    torchpar.init_process_group(backend="gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)  # after init_process_group: a pinned rank's share may hold more cores
    control = dist.new_group(backend="gloo")
    groups = {impl: dist.new_group(backend="gloo") for impl in IMPLS}  # no tag can cross between the two
    bubbles = world <= (os.cpu_count() or 1)  # a core per rank, or idle time is waiting for a core
    cases = [(s, m) for s in options["schedules"] for m in options["microbatches"]
             if not (s == "interleaved" and m % world)]
    rounds = options["rounds"]
    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=len(cases) * (2 * rounds + 2), desc=f"{world} ranks", unit="run")
    rows = []
    for schedule, m in cases:
        config = Config(schedule, m, groups)
        difference = config.gradient_difference()
        differences = gather(difference, world, control)
        if max(differences) > GRADIENT_RTOL:
            raise RuntimeError(f"{schedule}, m={m}, {world} ranks: torchpar's gradients differ from torch's by up to "
                               f"{max(differences):.3g} (relative) on rank {differences.index(max(differences))}")
        same_order = gather(config.same_order(), world, control)
        for impl in IMPLS:
            for _ in range(WARMUP_STEPS):
                config.step(impl)
        if progress:
            progress.update()
        # A short probe of the anchor (torch) sets how many steps fill the target time; it is the
        # slowest rank's time, so every rank gets the same count.
        config.steps = 2
        probe, _ = timed_run(config, "torch", control)
        config.steps = max(2, min(1000, int(options["seconds"] * 2 / probe)))
        for round_index in range(rounds):
            for impl in IMPLS if round_index % 2 == 0 else IMPLS[::-1]:
                elapsed, cpu = timed_run(config, impl, control)
                config.rates[impl].append(BATCH * config.steps / elapsed)
                config.cpu_ms[impl].append(cpu / config.steps * 1e3)
                if progress:
                    progress.update()
        memory = gather(measure_memory(config), world, control)
        costs = measure_costs(config, rank, world, control, options["cost_repeats"], "torchpar") if bubbles else None
        torch_costs = measure_costs(config, rank, world, control, options["cost_repeats"], "torch") if bubbles else None
        transfer_ms = measure_transfer(config, rank, control) if bubbles else None
        run_bubble = measure_run_bubble(config, world, control) if bubbles else None
        cpu_ms = {impl: [statistics.median(ms) for ms in gather(config.cpu_ms[impl], world, control)] for impl in IMPLS}
        if progress:
            progress.update()
        if rank == 0:
            row = dict(world=world, schedule=schedule, microbatches=m, virtual_stages=config.v,
                       torch_schedule=TORCH_SCHEDULES[schedule], balance=list(config.pipe.balance),
                       steps_per_round=config.steps, gradient_difference=max(differences),
                       same_order=None if same_order[0] is None else all(same_order),
                       cpu_ms_per_step=cpu_ms, description=MODEL_DESCRIPTION)
            for impl in IMPLS:
                row[f"{impl}_samples_per_s"] = statistics.median(config.rates[impl])
                row[f"{impl}_rounds"] = config.rates[impl]
            row["ratio_to_torch"] = statistics.median(
                [ours / theirs for ours, theirs in zip(config.rates["torchpar"], config.rates["torch"])])
            row["memory"] = memory
            # Without measured costs (oversubscribed ranks) the simulator's defaults F=1, B=2, I=W=1.
            simulation_costs = {"forward": 1.0, "backward": 2.0, "backward_input": 1.0, "backward_weight": 1.0}
            if costs:
                row["stage_costs_ms"] = costs
                row["torch_stage_costs_ms"] = torch_costs
                simulation_costs |= {name: statistics.mean(c[name] for c in costs)
                                     for name in simulation_costs if costs[0][name] is not None}
            simulation = simulate(schedule, world, m, config.v, **simulation_costs)
            row["simulated"] = dict(costs_ms=simulation_costs if costs else None,
                                    bubble_fraction=simulation.bubble_fraction,
                                    makespan_ms=simulation.makespan if costs else None,
                                    peak_activations=list(simulation.peak_activations))
            if costs:
                with_transfers = simulate(schedule, world, m, config.v, **simulation_costs, transfer=transfer_ms)
                row["simulated"] |= dict(transfer_ms=transfer_ms,
                                         bubble_fraction_with_transfers=with_transfers.bubble_fraction,
                                         makespan_ms_with_transfers=with_transfers.makespan)
                # The same prediction from the durations each stage's actions took inside the pipeline.
                names = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
                stage_costs = [{names[kind]: ms for kind, ms in stage.items()} | {"transfer": transfer_ms}
                               for stage in run_bubble["stage_ms"]]
                from_run = torchpar.pipeline.simulate_stages(schedule, world, m, config.v, stage_costs)
                # The simulator taught the host work each rank measured: every compute action of a stage takes
                # its rank's host work per action longer, and the bubble counts compute alone, as measured.
                host = run_bubble["host_ms_per_action"]
                with_host = [{name: ms + (host[stage % world] if name in names.values() else 0.0)
                              for name, ms in costs.items()} for stage, costs in enumerate(stage_costs)]
                from_run_with_host = torchpar.pipeline.simulate_stages(schedule, world, m, config.v, with_host)
                compute = m * sum(ms for stage in run_bubble["stage_ms"] for ms in stage.values())
                row["run_bubble"] = dict(measured=run_bubble["measured"], stage_ms=run_bubble["stage_ms"],
                                         predicted=from_run.bubble_fraction, host_ms_per_action=host,
                                         predicted_with_host=1 - compute / (world * from_run_with_host.makespan))
            if costs:
                row["bubble"] = bubble_figures(row, world)
            rows.append(row)
        del config
        gc.collect()
    if progress:
        progress.close()
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def bubble_figures(row: dict, world: int) -> dict:
    """Measured bubbles from the step times and each engine's isolated stage costs (and CPU time)."""
    m, split = row["microbatches"], row["schedule"] == "zero_bubble"
    busy = {}  # per engine, ms of compute per step on each rank
    for impl, costs in (("torchpar", row["stage_costs_ms"]), ("torch", row["torch_stage_costs_ms"])):
        busy[impl] = [0.0] * world
        for cost in costs:
            passes = cost["forward"] + (cost["backward_input"] + cost["backward_weight"] if split else cost["backward"])
            busy[impl][cost["rank"]] += m * passes
    figures = {"compute_ms_per_rank": busy["torchpar"], "torch_compute_ms_per_rank": busy["torch"],
               "simulated": row["simulated"]["bubble_fraction"],
               "with_transfers": row["simulated"]["bubble_fraction_with_transfers"],
               "predicted_step_ms": row["simulated"]["makespan_ms_with_transfers"]}
    for impl in IMPLS:
        step_ms = BATCH / row[f"{impl}_samples_per_s"] * 1e3
        figures[f"{impl}_step_ms"] = step_ms
        figures[f"{impl}_measured"] = 1 - statistics.mean(busy[impl]) / step_ms
        figures[f"{impl}_cpu_measured"] = 1 - statistics.mean(row["cpu_ms_per_step"][impl]) / step_ms
    return figures


# ---------------------------------------------------------------------------------------------------
# Report


def label(row: dict, separator: str = " ") -> str:
    schedule = row["schedule"] + (f" v={row['virtual_stages']}" if row["virtual_stages"] > 1 else "")
    return f"{schedule}{separator}m={row['microbatches']}"


def tick(row: dict) -> str:
    chunks = f"v={row['virtual_stages']} " if row["virtual_stages"] > 1 else ""
    return f"{row['schedule']}\n{chunks}m={row['microbatches']}"


def throughput_table(rows: list[dict]) -> str:
    lines = ["| ranks | schedule | m | torch schedule | torch samples/s | torchpar samples/s | torchpar/torch "
             "| CPU ms/step torch | CPU ms/step torchpar |",
             "| ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        schedule = r["schedule"] + (f" (v={r['virtual_stages']})" if r["virtual_stages"] > 1 else "")
        cpu = {impl: "/".join(f"{ms:.0f}" for ms in r["cpu_ms_per_step"][impl]) for impl in IMPLS}
        lines.append(f"| {r['world']} | {schedule} | {r['microbatches']} | {r['torch_schedule']} "
                     f"| {r['torch_samples_per_s']:.0f} | {r['torchpar_samples_per_s']:.0f} | {r['ratio_to_torch']:.2f} "
                     f"| {cpu['torch']} | {cpu['torchpar']} |")
    return "\n".join(lines)


def bubble_table(rows: list[dict]) -> str:
    lines = ["| ranks | schedule | m | torchpar F / B (I+W) ms | torch F / B (I+W) ms | transfer ms "
             "| predicted bubble, free transfers | predicted bubble, measured transfers | predicted step ms "
             "| torchpar step ms | torchpar measured | difference | torchpar busy-CPU bubble | torch measured |",
             "| ---: | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def passes(costs: dict, split: bool) -> str:
        return (f"{costs['forward']:.2f} / {costs['backward_input']:.2f}+{costs['backward_weight']:.2f}" if split
                else f"{costs['forward']:.2f} / {costs['backward']:.2f}")

    for r in rows:
        if "bubble" not in r:
            continue
        b, sim, split = r["bubble"], r["simulated"], r["schedule"] == "zero_bubble"
        torch_costs = {name: statistics.mean(c[name] for c in r["torch_stage_costs_ms"])
                       for name in ("forward", "backward", "backward_input", "backward_weight")
                       if r["torch_stage_costs_ms"][0][name] is not None}
        predicted = sim["bubble_fraction_with_transfers"]
        lines.append(f"| {r['world']} | {label(r).rsplit(' m=', 1)[0]} | {r['microbatches']} "
                     f"| {passes(sim['costs_ms'], split)} | {passes(torch_costs, split)} "
                     f"| {sim['transfer_ms']:.2f} | {b['simulated']:.1%} | {predicted:.1%} "
                     f"| {sim['makespan_ms_with_transfers']:.1f} | {b['torchpar_step_ms']:.1f} "
                     f"| {b['torchpar_measured']:.1%} | {(b['torchpar_measured'] - predicted) * 100:+.1f} pp "
                     f"| {b['torchpar_cpu_measured']:.1%} | {b['torch_measured']:.1%} |")
    return "\n".join(lines)


def run_bubble_table(rows: list[dict]) -> str:
    lines = ["| ranks | schedule | m | in-run F / B (I+W) ms per stage | transfer ms | predicted bubble | host ms per "
             "action (per rank) | predicted with host work | measured bubble (torchpar's timeline) | difference |",
             "| ---: | --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        if "run_bubble" not in r:
            continue
        b = r["run_bubble"]
        passes = ", ".join(f"{ms['F']:.2f} / {ms['I']:.2f}+{ms['W']:.2f}" if "I" in ms else f"{ms['F']:.2f} / {ms['B']:.2f}"
                           for ms in b["stage_ms"])
        host = ", ".join(f"{ms:.2f}" for ms in b["host_ms_per_action"])
        lines.append(f"| {r['world']} | {label(r).rsplit(' m=', 1)[0]} | {r['microbatches']} | {passes} "
                     f"| {r['simulated']['transfer_ms']:.2f} | {b['predicted']:.1%} | {host} "
                     f"| {b['predicted_with_host']:.1%} | {b['measured']:.1%} "
                     f"| {(b['measured'] - b['predicted_with_host']) * 100:+.1f} pp |")
    return "\n".join(lines)


def memory_rows(rows: list[dict]) -> list[tuple[dict, int]]:
    return [(r, rank) for r in rows if r["world"] == 2 and r["microbatches"] == MEMORY_MICROBATCHES
            for rank in range(r["world"])]


def predicted_bytes(row: dict, rank: int) -> float | None:
    if "stage_costs_ms" not in row:
        return None
    units = [c["activation_bytes"] for c in row["stage_costs_ms"] if c["rank"] == rank]
    return row["simulated"]["peak_activations"][rank] * statistics.mean(units)


def memory_table(rows: list[dict]) -> str:
    lines = ["| schedule | rank | simulated peak (stage x micro-batch) | predicted saved MB | torchpar saved MB "
             "| torch saved MB | torchpar allocated MB | torch allocated MB |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r, rank in memory_rows(rows):
        memory, predicted = r["memory"][rank], predicted_bytes(r, rank)
        lines.append(f"| {label(r)} | {rank} | {r['simulated']['peak_activations'][rank]} "
                     f"| {'n/a' if predicted is None else f'{predicted / MB:.2f}'} "
                     f"| {memory['torchpar_saved_bytes'] / MB:.2f} | {memory['torch_saved_bytes'] / MB:.2f} "
                     f"| {memory['torchpar_allocated_bytes'] / MB:.2f} | {memory['torch_allocated_bytes'] / MB:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(3, 1, figsize=(max(9.0, 0.75 * len(rows) + 2), 13))
    width = 0.38
    positions = range(len(rows))
    axis = axes[0]
    for offset, impl, color in ((-0.5, "torch", "tab:blue"), (0.5, "torchpar", "tab:orange")):
        axis.bar([p + offset * width for p in positions], [r[f"{impl}_samples_per_s"] for r in rows], width,
                 label=f"{impl} pipeline", color=color)
    for p, r in zip(positions, rows):
        axis.text(p, max(r["torch_samples_per_s"], r["torchpar_samples_per_s"]), f"{r['ratio_to_torch']:.2f}x",
                  ha="center", va="bottom", fontsize=7)
    axis.set_xticks(list(positions), [f"{r['world']} ranks\n{tick(r)}" for r in rows], fontsize=7)
    axis.set(ylabel="samples/s (slowest rank)", title=f"Throughput, {MODEL_DESCRIPTION} (label: torchpar/torch)")
    axis.legend(fontsize=8)

    axis = axes[1]
    measured = [r for r in rows if "bubble" in r]
    places = range(len(measured))
    for offset, key, name, color in ((-2, "simulated", "predicted, transfers free", "gainsboro"),
                                     (-1, "with_transfers", "predicted, measured transfers", "gray"),
                                     (0, "torchpar_measured", "torchpar measured (isolated costs as busy)",
                                      "tab:orange"),
                                     (1, "torchpar_cpu_measured", "torchpar measured (main-thread CPU as busy)",
                                      "navajowhite"),
                                     (2, "torch_measured", "torch measured (isolated costs as busy)", "tab:blue")):
        axis.bar([p + offset * 0.16 for p in places], [100 * r["bubble"][key] for r in measured], 0.16,
                 label=name, color=color)
    axis.set_xticks(list(places), [f"{r['world']} ranks\n{tick(r)}" for r in measured], fontsize=7)
    axis.set(ylabel="bubble (% of step time)",
             title="Bubble: 1 - compute per rank / step time (only where each rank has a core)")
    axis.legend(fontsize=8)

    axis = axes[2]
    cases = memory_rows(rows)
    spots = range(len(cases))
    series = (("predicted saved", "lightgray", lambda r, k: (predicted_bytes(r, k) or 0) / MB),
              ("torchpar saved", "tab:orange", lambda r, k: r["memory"][k]["torchpar_saved_bytes"] / MB),
              ("torch saved", "tab:blue", lambda r, k: r["memory"][k]["torch_saved_bytes"] / MB),
              ("torchpar all allocations", "navajowhite", lambda r, k: r["memory"][k]["torchpar_allocated_bytes"] / MB),
              ("torch all allocations", "lightsteelblue", lambda r, k: r["memory"][k]["torch_allocated_bytes"] / MB))
    bar = 0.8 / len(series)
    for offset, (name, color, value) in enumerate(series):
        axis.bar([s + (offset - (len(series) - 1) / 2) * bar for s in spots], [value(r, k) for r, k in cases], bar,
                 label=name, color=color)
    axis.set_xticks(list(spots), [f"{tick(r)}\nrank {k}" for r, k in cases], fontsize=7)
    axis.set(ylabel="peak during a step (MB)", title=f"Peak memory per rank, 2 ranks, m={MEMORY_MICROBATCHES}")
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def pipeline_targets(rows: list[dict]) -> list[targets.Target]:
    """torchpar/torch in every row; the bubble torchpar measures in its own run within 5 points of the
    simulator's prediction from the same run's stage costs, for 1F1B and ZB-H1 at m = 8 on 2 ranks."""
    checks = [targets.at_least("torchpar/torch, lowest row", min(r["ratio_to_torch"] for r in rows), 1.2)]
    for r in rows:
        measured_in_run = "run_bubble" in r
        if (r["world"], r["microbatches"]) == (2, 8) and r["schedule"] in ("1f1b", "zero_bubble") and measured_in_run:
            bubble = r["run_bubble"]
            checks.append(targets.at_most(f"{label(r)}: measured - predicted bubble (host work included), points",
                                          100 * abs(bubble["measured"] - bubble["predicted_with_host"]), 5))
            checks.append(targets.at_most(f"{label(r)}: measured - predicted bubble (compute and links only), points",
                                          100 * (bubble["measured"] - bubble["predicted"]), 5))
    return checks


def main() -> None:
    from torchpar.pipeline import SCHEDULES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--microbatches", type=int, nargs="+", default=None,
                        help="micro-batches per step (default 4 8; --quick 8)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per pair (default 10; --quick 3)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="target seconds per timed run (default 0.25; --quick 0.1)")
    parser.add_argument("--quick", action="store_true", help="a sanity run of about a minute")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    say_whether_pinned()
    options = dict(schedules=args.schedules, microbatches=args.microbatches or ([8] if args.quick else [4, 8]),
                   rounds=args.rounds or (3 if args.quick else 10), seconds=args.seconds or (0.1 if args.quick else 0.25),
                   cost_repeats=5 if args.quick else 15)
    if any(BATCH % m for m in options["microbatches"]):
        parser.error(f"micro-batches must divide the batch of {BATCH}")
    start = time.perf_counter()
    load = os.getloadavg()[0]
    if load > 0.5:
        logger.info("load average %.1f before starting (%d cores): other work on this machine makes timings noisy",
                    load, os.cpu_count())
    rows = []
    for world in args.worlds:
        rows.extend(run_world(world, rank_main, options))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "pipeline.png")
    ratios = [r["ratio_to_torch"] for r in rows]
    notes = []
    skipped = [w for w in args.worlds if not any("bubble" in r for r in rows if r["world"] == w)]
    if skipped:
        notes.append(f"no bubble figures for {', '.join(map(str, skipped))} ranks: more ranks than the "
                     f"{os.cpu_count()} cores, so idle time there is mostly waiting for a core")
    for r in rows:
        if r["same_order"] is False:
            why = (" (torchpar follows Megatron-LM: with m == ranks every forward runs before the first backward)"
                   if r["schedule"] == "interleaved" and r["microbatches"] == r["world"] else "")
            notes.append(f"{r['world']} ranks, {label(r)}: torch's compute order differs from torchpar's{why}")
    index = {(r["world"], r["schedule"], r["microbatches"]): r for r in rows}
    for (world, schedule, m), r in index.items():
        if schedule == "zero_bubble" and (world, "1f1b", m) in index:
            base = index[(world, "1f1b", m)]
            notes.append(f"{world} ranks, m={m}: zero_bubble / 1f1b samples/s: torchpar "
                         f"{r['torchpar_samples_per_s'] / base['torchpar_samples_per_s']:.2f}, torch "
                         f"{r['torch_samples_per_s'] / base['torch_samples_per_s']:.2f} (medians of separate runs)")
    logger.info("%s\n\n%s\n\n%s\n\n%s\n\ntorchpar/torch: lowest %.2f, median %.2f%s\n\n%s\nwrote %s and %s "
                "in %.0f s",
                throughput_table(rows), run_bubble_table(rows), bubble_table(rows), memory_table(rows), min(ratios),
                statistics.median(ratios), "".join(f"\n{note}" for note in notes),
                targets.table(pipeline_targets(rows)), args.out / "pipeline.json", args.out / "pipeline.png",
                time.perf_counter() - start)


if __name__ == "__main__":
    main()
