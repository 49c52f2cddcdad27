"""Training throughput: torchpar's DistributedDataParallel beside torch's, same model, data and backend.

    python benchmarks/ddp.py [--worlds 2 4] [--models mlp cnn transformer] [--backends gloo shm]
                             [--quick] [--out benchmarks/results]

For each world size the script spawns that many ranks on this host (one thread each). Every rank
joins a Gloo group and an shm group and, per model, builds from the same initial weights:

    no-comm       the plain module: the same steps without any communication (the floor)
    all-reduce after backward
                  the plain module, its gradients averaged by one all-reduce on the shm group after backward:
                  the ranks' meeting and the transfer, with no overlap and no DDP machinery (shm rows only)
    torch         torch.nn.parallel.DistributedDataParallel on each backend
    torchpar      torchpar.DistributedDataParallel on each backend, constructed the same way (given the Gloo
                  group, it moves the gradients and buffers through an shm group beside it, as it does on
                  one host by default; TORCHPAR_DDP_SAME_HOST=0 keeps them on Gloo)

Each variant runs the same training step (forward, cross-entropy, backward, SGD step) on the same
per-rank batch. Variants are timed alternately in the same processes, in several rounds (the order
rotates each round; torch's and torchpar's DDP on one backend run back to back, the same number of
steps, taking turns to go first); a measurement is the slowest rank's time (a separate Gloo control
group takes the max). A variant's rate is the median over rounds, and torchpar/torch the median of
the per-round ratios, which cancels most of the machine's drift (with more ranks than cores, as 4
ranks on 2 cores, single runs vary by tens of percent). After timing, every DDP variant's
parameters are checked to be identical on all ranks (each rank trains on different data, so a DDP
that skipped its all-reduce would fail this). Models:

    mlp           64-512-512-10 MLP, batch 64
    cnn           2 x (conv 3x3 + BatchNorm + ReLU + max-pool) + linear on 3x32x32, batch 32
    transformer   one nn.TransformerEncoderLayer (d_model 128, 4 heads, ff 512) + linear, batch 16 x seq 32

Writes <out>/ddp.json and ddp.png and prints the table: steps/s per variant, torchpar/torch, each DDP's
overhead over no-comm (extra time per step) and, on shm, the all-reduce after backward's; then the
targets (median torchpar/torch >= 1.10, the shm MLP's overhead <= 15%) and which hold. The default run
takes a few minutes on a 2-core machine; --quick is a sanity run of about a minute.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import pathlib
import statistics
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

import targets
from bench_ranks import join_world, run_world, say_whether_pinned

logger = logging.getLogger("torchpar.bench")
BACKENDS = ("gloo", "shm")
IMPLS = ("torch", "torchpar")
FLOOR = "all-reduce after backward"
WARMUP_STEPS = 5  # DDP rebuilds its buckets after the first iteration; none of that is timed
LR = 0.01


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    description: str


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x).mean(dim=1))


def labelled(shape: tuple[int, ...]) -> Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    return lambda generator: (torch.randn(shape, generator=generator),
                              torch.randint(0, 10, (shape[0],), generator=generator))


MODELS = {
    "mlp": ModelSpec(mlp, labelled((64, 64)), "MLP 64-512-512-10, batch 64"),
    "cnn": ModelSpec(cnn, labelled((32, 3, 32, 32)), "CNN 2x(conv+BN), 3x32x32, batch 32"),
    "transformer": ModelSpec(TransformerBlock, labelled((16, 32, 128)),
                             "TransformerEncoderLayer d128 h4, batch 16 x seq 32"),
}


class Variant:
    """One model copy with its own optimizer; `step` is one training step; `rates` collects steps/s."""

    def __init__(self, name: str, backend: str, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        self.name, self.backend, self.module, self.x, self.y = name, backend, module, x, y
        self.optimizer = torch.optim.SGD(module.parameters(), lr=LR)
        self.loss_fn = nn.CrossEntropyLoss()
        self.steps = 0  # per timed run
        self.rates: list[float] = []

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.loss_fn(self.module(self.x), self.y).backward()
        self.optimizer.step()


class AllreduceAfterBackward(Variant):
    """The plain module, its gradients averaged in place by one all-reduce after backward: what a data-parallel
    step costs when nothing overlaps backward and no DDP machinery runs (the ranks' meeting and the transfer)."""

    def __init__(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, group) -> None:
        super().__init__(FLOOR, "shm", module, x, y)
        self.group, self.options = group, dist.AllreduceCoalescedOptions()
        self.options.reduceOp = dist.ReduceOp.AVG

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.loss_fn(self.module(self.x), self.y).backward()
        self.group.allreduce_coalesced([p.grad for p in self.module.parameters()], self.options).wait()
        self.optimizer.step()


def steps_per_second(variant: Variant, control, steps: int) -> float:
    """The slowest rank's rate over `steps` steps."""
    dist.barrier(group=control)
    start = time.perf_counter()
    for _ in range(steps):
        variant.step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=control)
    return steps / elapsed.item()


def check_in_sync(variant: Variant, control, world: int) -> None:
    """DDP keeps every rank's parameters identical; raise on every rank if they are not."""
    flat = torch.cat([p.detach().reshape(-1) for p in variant.module.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0, group=control)
    mine = torch.tensor([0.0 if torch.allclose(flat, reference, rtol=1e-5, atol=1e-6) else
                         (flat - reference).abs().max().item()], dtype=torch.float64)
    differences = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(differences, mine, group=control)
    apart = {rank: d.item() for rank, d in enumerate(differences) if d.item()}
    if apart:
        raise RuntimeError(f"{variant.name} DDP on {variant.backend}: after training, the parameters of rank(s) "
                           f"{sorted(apart)} differ from rank 0's (by up to {max(apart.values()):.3g})")


def rank_main(rank: int, world: int, port: int, config: dict, results) -> None:
    import torchpar

    control, groups = join_world(rank, world, port)
    # torch 2.15 renames broadcast_buffers to forward_sync_buffers (same meaning for True); both DDPs get
    # the same, long-standing keyword, so silence torch's notice about it.
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
    ddp_classes = {"torch": torch.nn.parallel.DistributedDataParallel, "torchpar": torchpar.DistributedDataParallel}
    backends, rounds = config["backends"], config["rounds"]
    progress = None
    if rank == 0:
        from tqdm import tqdm

        total = len(config["models"]) * (1 + ("shm" in backends) + len(IMPLS) * len(backends)) * rounds
        progress = tqdm(total=total, desc=f"{world} ranks", unit="run")
    rows = []
    for model_name in config["models"]:
        spec = MODELS[model_name]
        torch.manual_seed(0)
        initial = spec.build()  # the same weights for every variant (and, by the seed, on every rank)
        x, y = spec.batch(torch.Generator().manual_seed(1000 + rank))  # each rank its own data
        # Units are timed back to back: no-comm alone, and torch's and torchpar's DDP on one backend as a
        # pair (the same number of steps each, adjacent in time, so a slow spell of the machine hits both).
        units = [[Variant("no-comm", "none", copy.deepcopy(initial), x, y)]]
        if "shm" in backends:
            units.append([AllreduceAfterBackward(copy.deepcopy(initial), x, y, groups["shm"])])
        for backend in backends:
            units.append([])
            for impl in IMPLS:
                module = ddp_classes[impl](copy.deepcopy(initial), process_group=groups[backend],
                                           bucket_cap_mb=config["bucket_cap_mb"], broadcast_buffers=True)
                units[-1].append(Variant(impl, backend, module, x, y))
        for unit in units:
            for variant in unit:
                for _ in range(WARMUP_STEPS):
                    variant.step()
            # A short probe of the unit's first variant (no-comm, or torch's DDP: the anchor) sets how many
            # steps fill the target time; it is the slowest rank's, so the count is the same on every rank.
            probe = steps_per_second(unit[0], control, 3)
            for variant in unit:
                variant.steps = max(3, min(10000, int(config["seconds"] * probe)))
        for round_index in range(rounds):
            shift = round_index % len(units)
            for unit in units[shift:] + units[:shift]:
                for variant in unit if round_index % 2 == 0 else unit[::-1]:
                    variant.rates.append(steps_per_second(variant, control, variant.steps))
                    if progress:
                        progress.update()
        for unit in units[1:]:
            for variant in unit:
                check_in_sync(variant, control, world)
        parameters = sum(p.numel() for p in initial.parameters())
        for unit in units:
            for variant in unit:
                row = dict(model=model_name, world=world, backend=variant.backend, impl=variant.name,
                           steps_per_s=statistics.median(variant.rates), rounds=variant.rates,
                           steps_per_round=variant.steps, parameters=parameters, description=spec.description)
                if variant.name == "torchpar":
                    # torchpar/torch per round (the two were timed back to back), median over rounds.
                    anchor = unit[IMPLS.index("torch")]
                    row["ratio_to_torch"] = statistics.median(
                        [ours / theirs for ours, theirs in zip(variant.rates, anchor.rates)])
                rows.append(row)
    if progress:
        progress.close()
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def table(rows: list[dict]) -> str:
    index = {(r["model"], r["world"], r["backend"], r["impl"]): r["steps_per_s"] for r in rows}
    ratio = {(r["model"], r["world"], r["backend"]): r["ratio_to_torch"] for r in rows if r["impl"] == "torchpar"}
    lines = ["| model | ranks | backend | no-comm | torch DDP | torchpar DDP | torchpar/torch "
             "| torch overhead | torchpar overhead | all-reduce after backward |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for model, world, backend in comparisons(rows):
        alone = index[(model, world, "none", "no-comm")]
        ours, theirs = index[(model, world, backend, "torchpar")], index[(model, world, backend, "torch")]
        floor = index.get((model, world, backend, FLOOR))
        lines.append(f"| {model} | {world} | {backend} | {alone:.1f}/s | {theirs:.1f}/s | {ours:.1f}/s "
                     f"| {ratio[(model, world, backend)]:.2f} | {overhead(alone, theirs)} | {overhead(alone, ours)} "
                     f"| {overhead(alone, floor) if floor else '—'} |")
    return "\n".join(lines)


def comparisons(rows: list[dict]) -> list[tuple[str, int, str]]:
    """(model, world, backend) for every DDP measurement, in the order they were run."""
    seen = {}
    for r in rows:
        if r["impl"] == "torchpar":
            seen[(r["model"], r["world"], r["backend"])] = None
    return list(seen)


def overhead(alone: float, ddp: float) -> str:
    """Extra time per step over no-comm, in percent of no-comm's step time."""
    return f"{(alone / ddp - 1) * 100:+.0f}%"


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    index = {(r["model"], r["world"], r["backend"], r["impl"]): r["steps_per_s"] for r in rows}
    figure, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.5), squeeze=False)
    width = 0.27
    for axis, model in zip(axes[0], models):
        cases = [(world, backend) for m, world, backend in comparisons(rows) if m == model]
        positions = range(len(cases))
        series = (("no-comm", "lightgray", lambda w, b: index[(model, w, "none", "no-comm")]),
                  ("torch DDP", "tab:blue", lambda w, b: index[(model, w, b, "torch")]),
                  ("torchpar DDP", "tab:orange", lambda w, b: index[(model, w, b, "torchpar")]))
        for offset, (label, color, value) in enumerate(series):
            axis.bar([p + (offset - 1) * width for p in positions], [value(w, b) for w, b in cases], width,
                     label=label, color=color)
        axis.set_xticks(list(positions), [f"{backend}\n{world} ranks" for world, backend in cases])
        description = next(r["description"] for r in rows if r["model"] == model)
        axis.set(title=f"{model}: {description}", ylabel="training steps/s (slowest rank)")
        axis.title.set_fontsize(9)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def ddp_targets(rows: list[dict]) -> list[targets.Target]:
    """torchpar/torch over every row; on shm, the MLP's overhead over training without communication."""
    steps = {(r["model"], r["world"], r["backend"], r["impl"]): r["steps_per_s"] for r in rows}
    ratios = [r["ratio_to_torch"] for r in rows if r["impl"] == "torchpar"]
    checks = [targets.at_least("torchpar/torch, median of the rows", statistics.median(ratios), 1.10)]
    for model, world, backend in comparisons(rows):
        if (model, backend) == ("mlp", "shm"):
            alone, ours = steps[(model, world, "none", "no-comm")], steps[(model, world, backend, "torchpar")]
            checks.append(targets.at_most(f"shm MLP, {world} ranks: torchpar's overhead over no-comm",
                                          alone / ours - 1, 0.15))
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant (default 10; --quick 3)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="target seconds per timed run (default 0.5; --quick 0.15)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25)
    parser.add_argument("--quick", action="store_true", help="a sanity run of about a minute")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    say_whether_pinned()
    config = dict(models=args.models, backends=args.backends, bucket_cap_mb=args.bucket_cap_mb,
                  rounds=args.rounds or (3 if args.quick else 10),
                  seconds=args.seconds or (0.15 if args.quick else 0.5))
    start = time.perf_counter()
    rows = []
    for world in args.worlds:
        rows.extend(run_world(world, rank_main, config))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ddp.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "ddp.png")
    logger.info("%s\n\n%s\nwrote %s and %s in %.0f s", table(rows), targets.table(ddp_targets(rows)),
                args.out / "ddp.json", args.out / "ddp.png", time.perf_counter() - start)


if __name__ == "__main__":
    main()
