"""Sharded data parallelism (ZeRO stages 1, 2 and 3): torchpar's ShardedDataParallel beside torch's ZeRO and FSDP2.

    python benchmarks/sharded.py [--worlds 2 4] [--backends gloo shm] [--quick] [--out benchmarks/results]

For each world size the script spawns that many ranks on this host (one thread each). Every rank joins a Gloo
group and an shm group and, per backend, builds from the same initial weights of a small transformer (3
nn.TransformerEncoderLayer blocks, d_model 256, 4 heads, ff 1024, + a linear head; 2.37 M parameters, 9 MiB;
batch 4 x seq 32 per rank, each rank its own data), trained with Adam:

    torch ZeRO+DDP    torch.nn.parallel.DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer
                      (Adam): torch's ZeRO-1, the anchor
    torchpar DDP      torchpar.DistributedDataParallel + plain Adam (given the Gloo group, it moves the gradients
                      through an shm group beside it, as it does on one host by default)
    torchpar stage 1  torchpar.ShardedDataParallel(stage=1) + torchpar.ShardedOptimizer(Adam)
    torchpar stage 2  torchpar.ShardedDataParallel(stage=2) + torchpar.ShardedOptimizer(Adam)
    torch FSDP2       torch's fully_shard on every block and the root, reshard_after_forward=False (ZeRO-2-like:
                      parameters gathered once per step, gradients reduce-scattered), on a DeviceMesh of the same
                      group; Adam over its sharded parameters
    torchpar stage 3  torchpar.ShardedDataParallel(stage=3, units=the blocks) + ShardedOptimizer(Adam): each block
                      (and the root's head) all-gathered before its forward, freed after it, gathered again for
                      its backward (reshard_after_forward=True)
    torch FSDP2 reshard  fully_shard on the same units with reshard_after_forward=True: ZeRO-3, stage 3's anchor

Each step is zero_grad, forward, cross-entropy, backward, optimizer step. The variants on one backend are timed
alternately in the same processes, in several rounds (the order rotates each round, the same number of steps
each); a measurement is the slowest rank's time (a Gloo control group takes the max). A variant's rate is the
median over rounds and its ratios (to torch's ZeRO+DDP, to torchpar's DDP) the medians of the per-round ratios. A
variant that fails to build or to step on a backend is reported as not run, with the reason.

After timing, one more step measures what each rank holds: the optimizer state (the bytes of the tensors in the
optimizer's state on that rank: ZeroRedundancyOptimizer's local optimizer, ShardedOptimizer's inner one on the
shard, FSDP2's local shards), the gradients alive after backward (every parameter's .grad, and the shard's for
ShardedOptimizer; FSDP2's local shards) and the parameters after the step (every distinct storage the parameters
view, empty for a stage-3 unit between steps, plus ShardedDataParallel's flat shard; FSDP2's local shards), the
largest over the ranks, beside the ZeRO paper's prediction for Ψ parameters on N ranks in fp32 (DDP: state 2Ψ,
gradients Ψ, parameters Ψ; stage 1: 2Ψ/N, Ψ, Ψ; stage 2: 2Ψ/N, Ψ/N, Ψ; stage 3 and FSDP2: 2Ψ/N, Ψ/N, Ψ/N; × 4
bytes, padding aside); and each rank process's peak resident set over the whole run (ru_maxrss), as a reference.
The peak allocated is the allocator's view (torchpar.allocator counts every CPU tensor allocation): what the variant
allocated through its build and warm-up and still holds (parameters, optimizer state, a wrapper's buckets, flat
shard and communication buffers) plus the most that measured step allocated on top — the variant's peak on a
rank, the largest over the ranks.
Then every variant's parameters are checked to be identical on all ranks, and each stage's bytes_sent_last_step
against DDP's ring all-reduce, 2 (N-1)/N Ψ × 4: stages 1 and 2 exactly the ring's reduce-scatter and all-gather
of the padded parameters, stage 3 1.5x within 5%.

Writes <out>/sharded.json and sharded.png and prints the table, the bytes check and the targets (stages 1 and 2 ≥
0.95 × torchpar's DDP and ≥ torch's ZeRO+DDP; stage 3 ≥ 1.2 × FSDP2 resharding after forward at no more memory)
with which hold. The default run takes a few minutes on a 2-core machine; --quick is a sanity run of about a minute (2 and 4 ranks).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import pathlib
import resource
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

import targets
from bench_ranks import join_world, run_world, say_whether_pinned

logger = logging.getLogger("torchpar.bench")
BACKENDS = ("gloo", "shm")
ANCHOR, DDP, STAGE1, STAGE2, FSDP2 = "torch ZeRO+DDP", "torchpar DDP", "torchpar stage 1", "torchpar stage 2", \
    "torch FSDP2"
STAGE3, FSDP2_RESHARD = "torchpar stage 3", "torch FSDP2 reshard"
VARIANTS = (ANCHOR, DDP, STAGE1, STAGE2, FSDP2, STAGE3, FSDP2_RESHARD)
STAGES = {STAGE1: 1, STAGE2: 2, STAGE3: 3}
WARMUP_STEPS = 3  # Adam's state is created and DDP rebuilds its buckets in the first steps; none of that is timed
LR = 1e-3
D_MODEL, HEADS, FF, BLOCKS, CLASSES = 256, 4, 1024, 3, 10
BATCH, SEQUENCE = 4, 32
DESCRIPTION = f"{BLOCKS} x TransformerEncoderLayer d{D_MODEL} h{HEADS} ff{FF} + linear, batch {BATCH} x seq {SEQUENCE}"
FP32 = 4


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model=D_MODEL, nhead=HEADS, dim_feedforward=FF, dropout=0.0,
                                       batch_first=True) for _ in range(BLOCKS))
        self.head = nn.Linear(D_MODEL, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def predicted_bytes(variant: str, parameters: int, world: int) -> tuple[float, float, float]:
    """(optimizer state, gradients, parameters between steps) per rank by the ZeRO paper's count, Adam in fp32,
    padding aside: torch's ZeroRedundancyOptimizer under DDP is stage 1, FSDP2 without resharding after forward
    stage 2 (its parameters sharded between steps all the same), with resharding stage 3."""
    whole, part = parameters * FP32, parameters * FP32 / world
    return {ANCHOR: (2 * part, whole, whole), DDP: (2 * whole, whole, whole), STAGE1: (2 * part, whole, whole),
            STAGE2: (2 * part, part, whole), FSDP2: (2 * part, part, part), STAGE3: (2 * part, part, part),
            FSDP2_RESHARD: (2 * part, part, part)}[variant]


def local_bytes(tensor: torch.Tensor) -> int:
    """The bytes this rank holds of a tensor (a DTensor's local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class Variant:
    """One model copy with its optimizer on one backend; `step` is one training step; `rates` collects steps/s."""

    def __init__(self, name: str, backend: str, model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor,
                 state: dict, sharded: bool = False) -> None:
        self.name, self.backend, self.model, self.optimizer, self.x, self.y = name, backend, model, optimizer, x, y
        self.state = state  # the optimizer state this rank holds (for a wrapper, its inner optimizer's)
        self.sharded = sharded
        self.loss_fn = nn.CrossEntropyLoss()
        self.steps = 0  # per timed run
        self.rates: list[float] = []

    def forward_backward(self) -> None:
        self.optimizer.zero_grad()
        self.loss_fn(self.model(self.x), self.y).backward()

    def step(self) -> None:
        self.forward_backward()
        self.optimizer.step()

    def gradient_bytes(self) -> int:
        """Every gradient alive: the parameters' own, and the shard's for ShardedDataParallel."""
        tensors = list(self.model.parameters()) + (self.model.shard_parameters() if self.sharded else [])
        distinct = {id(t): t for t in tensors if t.grad is not None}
        return sum(local_bytes(t.grad) for t in distinct.values())

    def parameter_bytes(self) -> int:
        """The parameters' memory this rank holds: every distinct storage the parameters view (a stage-3 unit's
        is empty between steps; a DTensor counts its local shard), plus ShardedDataParallel's flat shard."""
        storages = {}
        for parameter in self.model.parameters():
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        shard = sum(local_bytes(s) for s in self.model.shard_parameters()) if self.sharded else 0
        return sum(size for pointer, size in storages.items() if pointer) + shard

    def state_bytes(self) -> int:
        return sum(local_bytes(value) for per_parameter in self.state.values() for value in per_parameter.values()
                   if isinstance(value, torch.Tensor))

    def full_parameters(self) -> torch.Tensor:
        """Every parameter whole, flat (collective: a DTensor's and a stage-3 unit's are gathered)."""
        if self.sharded:
            self.model.unshard()
        flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                          for p in self.model.parameters()])
        if self.sharded:
            self.model.reshard()
        return flat


def build(name: str, backend: str, group, initial: nn.Module, x: torch.Tensor, y: torch.Tensor,
          bucket_cap_mb: float) -> Variant:
    import torchpar
    from torch.distributed.optim import ZeroRedundancyOptimizer

    module = copy.deepcopy(initial)
    if name == ANCHOR:
        model = nn.parallel.DistributedDataParallel(module, process_group=group, bucket_cap_mb=bucket_cap_mb)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                            process_group=group, lr=LR)
        return Variant(name, backend, model, optimizer, x, y, optimizer.optim.state)
    if name == DDP:
        model = torchpar.DistributedDataParallel(module, process_group=group, bucket_cap_mb=bucket_cap_mb)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        return Variant(name, backend, model, optimizer, x, y, optimizer.state)
    if name in STAGES:
        units = [f"blocks.{i}" for i in range(BLOCKS)] if name == STAGE3 else None
        model = torchpar.ShardedDataParallel(module, stage=STAGES[name], process_group=group,
                                             bucket_cap_mb=bucket_cap_mb, units=units)
        optimizer = torchpar.ShardedOptimizer(model, torch.optim.Adam, lr=LR)
        return Variant(name, backend, model, optimizer, x, y, optimizer.optimizer.state, sharded=True)
    from torch.distributed.fsdp import fully_shard

    mesh = dist.device_mesh.DeviceMesh.from_group(group, "cpu")
    reshard = name == FSDP2_RESHARD
    for block in module.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    optimizer = torch.optim.Adam(module.parameters(), lr=LR)
    return Variant(name, backend, module, optimizer, x, y, optimizer.state)


def agreed_failure(control, world: int, error: str | None) -> str | None:
    """Every rank's outcome of a step all of them took: the first failing rank's reason, or None if none failed."""
    outcomes: list = [None] * world
    dist.all_gather_object(outcomes, error, group=control)
    failed = [(rank, reason) for rank, reason in enumerate(outcomes) if reason is not None]
    return f"rank {failed[0][0]}: {failed[0][1]}" if failed else None


def steps_per_second(variant: Variant, control, steps: int) -> float:
    """The slowest rank's rate over `steps` steps."""
    dist.barrier(group=control)
    start = time.perf_counter()
    for _ in range(steps):
        variant.step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=control)
    return steps / elapsed.item()


def per_rank(control, world: int, values: list[float]) -> list[list[float]]:
    """values of every rank, gathered over the control group: [rank][i]."""
    mine = torch.tensor(values, dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=control)
    return [g.tolist() for g in gathered]


def check_in_sync(variant: Variant, control, world: int) -> None:
    """Data parallelism keeps every rank's parameters identical; raise on every rank if they are not."""
    flat = variant.full_parameters()
    reference = flat.clone()
    dist.broadcast(reference, src=0, group=control)
    mine = 0.0 if torch.allclose(flat, reference, rtol=1e-5, atol=1e-6) else (flat - reference).abs().max().item()
    apart = {rank: d[0] for rank, d in enumerate(per_rank(control, world, [mine])) if d[0]}
    if apart:
        raise RuntimeError(f"{variant.name} on {variant.backend}: after training, the parameters of rank(s) "
                           f"{sorted(apart)} differ from rank 0's (by up to {max(apart.values()):.3g})")


def release_retained(groups: dict) -> None:
    """An shm group keeps its last queued op's tensors until its next op (its thread may not drop what Python
    owns); a tiny all-reduce on each (the Gloo group's shm one beside it included) releases them, so that what
    one variant left there is not counted as another's."""
    from torchpar.same_host import shm_group_beside

    beside = shm_group_beside(groups["gloo"], torch.device("cpu"))
    for group in [groups["shm"]] + ([beside] if beside is not None else []):  # in one order on every rank
        dist.all_reduce(torch.zeros(1), group=group)
    gc.collect()


def rank_main(rank: int, world: int, port: int, config: dict, results) -> None:
    from torchpar import allocator

    allocator.count_cpu_allocations()  # the allocator's view of each variant's peak (the module's docstring)
    control, groups = join_world(rank, world, port)
    backends, rounds = config["backends"], config["rounds"]
    torch.manual_seed(0)
    initial = Transformer()  # the same weights for every variant (and, by the seed, on every rank)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    x, y = torch.randn(BATCH, SEQUENCE, D_MODEL, generator=generator), torch.randint(0, CLASSES, (BATCH,),
                                                                                    generator=generator)
    parameters = sum(p.numel() for p in initial.parameters() if p.requires_grad)
    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=len(backends) * len(VARIANTS) * (rounds + 1), desc=f"{world} ranks", unit="run")
    units, not_run = [], {}
    for backend in backends:
        unit = []
        for name in VARIANTS:
            # Built, then warmed up, each phase agreed by all ranks, so that a rank whose build failed does not
            # leave the others in the warm-up's collectives (a failure inside a collective may still hang).
            variant, reason = None, None
            release_retained(groups)
            allocated_before = allocator.cpu_memory_allocated()
            for phase in ("build", "warm-up"):
                error = None
                try:
                    if phase == "build":
                        variant = build(name, backend, groups[backend], initial, x, y, config["bucket_cap_mb"])
                    else:
                        for _ in range(WARMUP_STEPS):
                            variant.step()
                except Exception as failure:  # noqa: BLE001 - reported as the row's reason, not raised
                    first_line = str(failure).splitlines()[0] if str(failure) else ""
                    error = f"{phase}: {type(failure).__name__}: {first_line}"[:300]
                reason = agreed_failure(control, world, error)
                if reason is not None:
                    break
            if reason is None:
                gc.collect()
                variant.persistent_bytes = allocator.cpu_memory_allocated() - allocated_before
                unit.append(variant)
            else:
                not_run[(backend, name)] = reason
                if rank == 0:
                    logger.warning("%s on %s, %d ranks: not run (%s)", name, backend, world, reason)
            if progress:
                progress.update()
        if unit:
            # A short probe of the unit's first variant (the anchor, when it runs) sets how many steps fill the
            # target time; it is the slowest rank's, so the count is the same on every rank.
            probe = steps_per_second(unit[0], control, 3)
            for variant in unit:
                variant.steps = max(3, min(10000, int(config["seconds"] * probe)))
            units.append(unit)
    for round_index in range(rounds):
        shift = round_index % len(units)
        for unit in units[shift:] + units[:shift]:
            turn = round_index % len(unit)
            for variant in unit[turn:] + unit[:turn]:
                variant.rates.append(steps_per_second(variant, control, variant.steps))
                if progress:
                    progress.update()
    if progress:
        progress.close()
    # What each rank holds: gradients alive after backward, then the optimizer state and the parameters after
    # the step.
    memory, sent, peaks = {}, {}, {}
    for unit in units:
        for variant in unit:
            release_retained(groups)
            variant.step()  # what its last op keeps, as between its own steps (its persistent bytes hold it too)
            gc.collect()
            before_step = allocator.cpu_memory_allocated()
            allocator.reset_cpu_peak_memory()
            variant.forward_backward()
            gradients = variant.gradient_bytes()
            variant.optimizer.step()
            peaks[(variant.backend, variant.name)] = per_rank(control, world, [
                variant.persistent_bytes + allocator.cpu_max_memory_allocated() - before_step])
            if variant.sharded:  # read now: gathering the parameters whole below would add to it
                sent[(variant.backend, variant.name)] = variant.model.bytes_sent_last_step
            memory[(variant.backend, variant.name)] = per_rank(
                control, world, [variant.state_bytes(), gradients, variant.parameter_bytes()])
    for unit in units:
        for variant in unit:
            check_in_sync(variant, control, world)
    peak_rss = [r[0] for r in per_rank(control, world, [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024])]
    rows = []
    for backend in backends:
        unit = next((u for u in units if u[0].backend == backend), [])
        by_name = {v.name: v for v in unit}
        for name in VARIANTS:
            predicted_state, predicted_gradients, predicted_parameters = predicted_bytes(name, parameters, world)
            row = dict(world=world, backend=backend, variant=name, parameters=parameters, description=DESCRIPTION,
                       predicted_state_bytes=predicted_state, predicted_gradient_bytes=predicted_gradients,
                       predicted_parameter_bytes=predicted_parameters,
                       peak_rss_bytes=max(peak_rss), peak_rss_bytes_per_rank=peak_rss)
            if name not in by_name:
                rows.append(dict(row, not_run=not_run.get((backend, name), "not built")))
                continue
            variant = by_name[name]
            held = memory[(backend, name)]
            row.update(steps_per_s=statistics.median(variant.rates), rounds=variant.rates,
                       steps_per_round=variant.steps,
                       state_bytes=max(h[0] for h in held), gradient_bytes=max(h[1] for h in held),
                       parameter_bytes=max(h[2] for h in held),
                       state_bytes_per_rank=[h[0] for h in held], gradient_bytes_per_rank=[h[1] for h in held],
                       peak_allocated_bytes=max(p[0] for p in peaks[(backend, name)]),
                       peak_allocated_bytes_per_rank=[p[0] for p in peaks[(backend, name)]])
            for key, reference in (("ratio_to_anchor", ANCHOR), ("ratio_to_ddp", DDP), ("ratio_to_fsdp2", FSDP2),
                                   ("ratio_to_fsdp2_reshard", FSDP2_RESHARD)):
                if reference in by_name:
                    row[key] = statistics.median(
                        [ours / theirs for ours, theirs in zip(variant.rates, by_name[reference].rates)])
            if variant.sharded:
                shard_bytes = sum(s.numel() * s.element_size() for s in variant.model.shard_parameters())
                row.update(bytes_sent_last_step=sent[(backend, name)],
                           padded_parameter_bytes=shard_bytes * world)
            rows.append(row)
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


def ratio(row: dict, key: str) -> str:
    return f"{row[key]:.2f}" if key in row else "—"


def fsdp2_alike(variant: str) -> tuple[str, str]:
    """The FSDP2 variant that gathers and frees as `variant` does, and its ratio's key: stage 3 reshards after
    forward, FSDP2 without resharding keeps the parameters gathered from forward to backward as stages 1 and 2."""
    return (FSDP2_RESHARD, "ratio_to_fsdp2_reshard") if variant == STAGE3 else (FSDP2, "ratio_to_fsdp2")


def table(rows: list[dict]) -> str:
    # Only the ratio columns' headers hold a "/": python -m torchpar.bench compares those between reports.
    lines = ["| ranks | backend | variant | steps per s | /torch ZeRO+DDP | /torchpar DDP | /torch FSDP2 alike "
             "| optimizer state MiB (predicted) | gradients MiB (predicted) | parameters MiB (predicted) "
             "| peak allocated MiB |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        head = f"| {r['world']} | {r['backend']} | {r['variant']} "
        if "not_run" in r:
            lines.append(head + f"| not run: {r['not_run'].replace('|', '/')} | — | — | — | — | — | — | — |")
            continue
        alike = ratio(r, fsdp2_alike(r["variant"])[1]) if r["variant"] in STAGES else "—"
        lines.append(head + f"| {r['steps_per_s']:.2f} | {ratio(r, 'ratio_to_anchor')} | {ratio(r, 'ratio_to_ddp')} "
                     f"| {alike} | {mib(r['state_bytes'])} ({mib(r['predicted_state_bytes'])}) "
                     f"| {mib(r['gradient_bytes'])} ({mib(r['predicted_gradient_bytes'])}) "
                     f"| {mib(r['parameter_bytes'])} ({mib(r['predicted_parameter_bytes'])}) "
                     f"| {mib(r['peak_allocated_bytes'])} |")
    return "\n".join(lines)


def sent_bytes_table(rows: list[dict]) -> str:
    """Each stage's bytes sent per step against DDP's ring all-reduce of the parameters, 2 (N-1)/N x Ψ x 4: stages 1
    and 2 send exactly the ring's reduce-scatter and all-gather of the padded parameters, 2 (N-1)/N x padded bytes
    (DDP's count, padding aside); stage 3 gathers each unit twice (forward, backward) and reduce-scatters it, 1.5x
    DDP's, less the root's second gather (it stays gathered from forward to backward): within 5% of 1.5x. Then
    each world's peak resident set per rank process (all variants, the whole run)."""
    lines = ["| ranks | backend | variant | bytes sent per step | DDP's ring all-reduce of the parameters "
             "| ratio | expected | holds |",
             "| ---: | --- | --- | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        if "bytes_sent_last_step" not in r:
            continue
        n, sent = r["world"], r["bytes_sent_last_step"]
        ring = 2 * (n - 1) / n * r["parameters"] * FP32
        if r["variant"] == STAGE3:
            expected, holds = "1.5 within 5%", abs(sent / ring - 1.5) <= 0.05 * 1.5
        else:
            exact = 2 * (n - 1) * r["padded_parameter_bytes"] // n
            expected, holds = f"{exact:,} bytes (padded)", sent == exact
        lines.append(f"| {n} | {r['backend']} | {r['variant']} | {sent:,} | {ring:,.0f} | {sent / ring:.3f} "
                     f"| {expected} | {'yes' if holds else 'no'} |")
    lines += ["", "| ranks | peak resident set per rank process, MiB: largest | smallest |", "| ---: | ---: | ---: |"]
    for world in dict.fromkeys(r["world"] for r in rows):
        rss = next(r["peak_rss_bytes_per_rank"] for r in rows if r["world"] == world)
        lines.append(f"| {world} | {mib(max(rss))} | {mib(min(rss))} |")
    return "\n".join(lines)


def held_bytes(row: dict) -> float:
    return row["state_bytes"] + row["gradient_bytes"] + row["parameter_bytes"]


def sharded_targets(rows: list[dict]) -> list[targets.Target]:
    """For every world and backend: stage 1 and 2 within 5% of torchpar's DDP and at least torch's ZeRO+DDP; stage
    3 at least 1.2x FSDP2 resharding after forward (the medians of the per-round ratios) at no more memory (its
    optimizer state, gradients and parameters held, within 1% for the two layouts' padding). A stage not run, or
    whose anchor did not, fails its targets."""
    checks = []
    by_key = {(r["world"], r["backend"], r["variant"]): r for r in rows}
    for r in rows:
        if r["variant"] not in STAGES:
            continue
        where = f"{r['variant']}, {r['world']} ranks {r['backend']}"
        bounds = ((("ratio_to_fsdp2_reshard", FSDP2_RESHARD, 1.2),) if r["variant"] == STAGE3 else
                  (("ratio_to_ddp", DDP, 0.95), ("ratio_to_anchor", ANCHOR, 1.0)))
        for key, reference, bound in bounds:
            name = f"{where}: /{reference}"
            if key in r:
                checks.append(targets.at_least(name, r[key], bound))
            else:
                checks.append(targets.Target(f"{name} >= {bound:g}", "not run", False))
        if r["variant"] == STAGE3:
            name = f"{where}: memory held / {FSDP2_RESHARD}'s"
            anchor = by_key.get((r["world"], r["backend"], FSDP2_RESHARD), {})
            if "state_bytes" in r and "state_bytes" in anchor:
                checks.append(targets.at_most(name, held_bytes(r) / held_bytes(anchor), 1.01))
            else:
                checks.append(targets.Target(f"{name} <= 1.01", "not run", False))
    return checks


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(VARIANTS, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                                 "tab:pink")))
    cases = list(dict.fromkeys((r["world"], r["backend"]) for r in rows))
    worlds = list(dict.fromkeys(r["world"] for r in rows))
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw=dict(width_ratios=[3, 2]))
    width = 0.8 / len(VARIANTS)
    index = {(r["world"], r["backend"], r["variant"]): r for r in rows}
    for offset, name in enumerate(VARIANTS):
        positions = [p + (offset - (len(VARIANTS) - 1) / 2) * width for p in range(len(cases))]
        values = [index.get((w, b, name), {}).get("steps_per_s", 0.0) for w, b in cases]  # 0: not run
        speed.bar(positions, values, width, label=name, color=colors[name])
    speed.set_xticks(range(len(cases)), [f"{backend}\n{world} ranks" for world, backend in cases])
    speed.set(title=f"training steps/s (slowest rank; median of rounds)\n{DESCRIPTION}", ylabel="steps/s")
    speed.title.set_fontsize(9)
    speed.legend(fontsize=8)
    # Memory is the backend's no matter: the first backend measured for each world.
    for offset, name in enumerate(VARIANTS):
        positions = [p + (offset - (len(VARIANTS) - 1) / 2) * width for p in range(len(worlds))]
        measured = [next((r for r in rows if r["world"] == w and r["variant"] == name and "state_bytes" in r), None)
                    for w in worlds]
        state = [r["state_bytes"] / 2**20 if r else 0 for r in measured]
        gradients = [r["gradient_bytes"] / 2**20 if r else 0 for r in measured]
        held = [r["parameter_bytes"] / 2**20 if r else 0 for r in measured]
        memory.bar(positions, state, width, color=colors[name])
        memory.bar(positions, gradients, width, bottom=state, color=colors[name], alpha=0.45, hatch="//")
        memory.bar(positions, held, width, bottom=[a + b for a, b in zip(state, gradients)], color=colors[name],
                   alpha=0.25, hatch="..")
        predicted = [sum(predicted_bytes(name, rows[0]["parameters"], w)) / 2**20 for w in worlds]
        memory.scatter(positions, predicted, marker="_", s=150, color="black", zorder=3,
                       label="ZeRO prediction" if offset == 0 else None)
    memory.set_xticks(range(len(worlds)), [f"{w} ranks" for w in worlds])
    memory.set_xlim(-0.5, len(worlds) - 0.5)
    memory.legend(fontsize=8)
    memory.set(title="per rank: optimizer state (solid) + gradients after backward (//) + parameters (..), MiB\n"
                     "bars in the left panel's order; black: the ZeRO formula", ylabel="MiB")
    memory.title.set_fontsize(9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant (default 7; --quick 3)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="target seconds per timed run (default 1.0; --quick 0.3)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25)
    parser.add_argument("--quick", action="store_true", help="a sanity run of about a minute")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    say_whether_pinned()
    config = dict(backends=args.backends, bucket_cap_mb=args.bucket_cap_mb,
                  rounds=args.rounds or (3 if args.quick else 7),
                  seconds=args.seconds or (0.3 if args.quick else 1.0))
    start = time.perf_counter()
    rows = []
    for world in args.worlds:
        rows.extend(run_world(world, rank_main, config))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharded.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "sharded.png")
    logger.info("%s\n\n%s\n\n%s\nwrote %s and %s in %.0f s", table(rows), sent_bytes_table(rows),
                targets.table(sharded_targets(rows)), args.out / "sharded.json", args.out / "sharded.png",
                time.perf_counter() - start)


if __name__ == "__main__":
    main()
