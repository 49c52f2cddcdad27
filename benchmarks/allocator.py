"""CPU memory between training steps: glibc's defaults (PyTorch's own, the anchor), glibc keeping freed memory (its
thresholds raised at launch, what torchpar.keep_freed_memory did before 2026-12-07) and torchpar's block cache
(torchpar.keep_freed_memory now: docs/launching.md), on the same model, ranks and steps.

    python3 benchmarks/allocator.py            # ~3 minutes: 2 ranks, stage 3 and DDP, 3 rounds
    python3 benchmarks/allocator.py --quick

The model is train_sharded's MLP (64-1024x6-10, 5.3 M parameters, Adam, 32 samples per rank), trained by torchpar's
sharded engine at stage 3 (each Linear a unit) and by torchpar's DDP. Each mode runs in fresh processes (glibc's
settings are the process's), the modes' order rotating each round. Per run, the slowest rank's median step, and
the fullest rank's resident set: its peak growth from just before wrapping, and how much it still grew between the
warm-up's end and the last step (a heap that keeps growing); beside them the allocator's peak of tensors
(torchpar.allocator) and, for the block cache, what it reserved. Table and PNG under --out.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import statistics
import sys
import time

import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it on its first step: tens of MiB, not the allocator's)
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_ranks import run_world, say_whether_pinned  # noqa: E402

logger = logging.getLogger("torchpar.bench.allocator")
MiB = 1 << 20
GLIBC_KEEPING = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
MODES = {  # name: (environment at launch, torchpar.keep_freed_memory())
    "glibc defaults (anchor)": ({}, False),
    "glibc keeping freed memory": (GLIBC_KEEPING, False),
    "torchpar block cache": ({}, True),
}
ENGINES = ("sharded stage 3", "ddp")


def resident_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def rank_main(rank: int, world: int, port: int, config: dict, results) -> None:
    import torchpar
    from torchpar import allocator

    if config["keep"]:
        torchpar.keep_freed_memory()
    else:
        allocator.count_cpu_allocations()
    # Only the groups the engines make (bench_ranks.join_world's extra shm group would add its segment's pages).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torchpar.init_process_group(backend="gloo")
    torch.set_num_threads(1)
    control = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    layers = [nn.Linear(64, 1024), nn.ReLU()]
    for _ in range(5):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(1024, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    allocator.reset_cpu_peak_memory()
    before = allocator.cpu_memory_allocated()
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    resident_before = resident_kib("VmRSS") - resident_kib("RssFile")
    if config["engine"] == "ddp":
        model = torchpar.DistributedDataParallel(net)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        model = torchpar.ShardedDataParallel(net, stage=3)
        optimizer = torchpar.ShardedOptimizer(model, torch.optim.Adam, lr=1e-3)
    times = []
    after_warmup = 0
    for step in range(config["warmup"] + config["steps"]):
        dist.barrier(group=control)
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        if step == config["warmup"] - 1:
            after_warmup = resident_kib("VmRSS") - resident_kib("RssFile")
    mine = torch.tensor([statistics.median(times[config["warmup"]:]) * 1e3,
                         (resident_kib("VmHWM") - resident_kib("RssFile") - resident_before) / 1024,
                         (resident_kib("VmRSS") - resident_kib("RssFile") - after_warmup) / 1024,
                         (allocator.cpu_max_memory_allocated() - before) / MiB,
                         allocator.cpu_max_memory_reserved() / MiB], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=control)  # the slowest rank, the fullest
    if rank == 0:
        step_ms, peak, grew, allocated, reserved = mine.tolist()
        results.put([dict(step_ms=step_ms, resident_peak_mib=peak, grew_after_warmup_mib=grew,
                          allocated_peak_mib=allocated, reserved_peak_mib=reserved)])
    del optimizer, model
    dist.destroy_process_group()


def run(engine: str, mode: str, config: dict) -> dict:
    environment, keep = MODES[mode]
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)  # the spawned ranks start with it: glibc reads it at their start
    try:
        row = run_world(config["world"], rank_main, dict(config, engine=engine, keep=keep))[0]
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return dict(row, engine=engine, mode=mode)


def summarise(runs: list[dict]) -> list[dict]:
    rows = []
    for engine in ENGINES:
        anchor_ms = statistics.median(r["step_ms"] for r in runs if r["engine"] == engine and
                                      r["mode"] == "glibc defaults (anchor)")
        for mode in MODES:
            mine = [r for r in runs if r["engine"] == engine and r["mode"] == mode]
            row = {key: statistics.median(r[key] for r in mine) for key in mine[0] if key not in ("engine", "mode")}
            row.update(engine=engine, mode=mode, rounds=len(mine), speedup=anchor_ms / row["step_ms"])
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| engine | allocator | step ms | steps/s vs glibc defaults | resident peak growth MiB | still grew after "
             "warm-up MiB | tensors' peak MiB | reserved MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        reserved = f"{r['reserved_peak_mib']:.1f}" if r["reserved_peak_mib"] else "-"
        lines.append(f"| {r['engine']} | {r['mode']} | {r['step_ms']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['resident_peak_mib']:.1f} | {r['grew_after_warmup_mib']:+.1f} | {r['allocated_peak_mib']:.1f} "
                     f"| {reserved} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path, description: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(MODES)
    for offset, mode in enumerate(MODES):
        positions = [e + (offset - (len(MODES) - 1) / 2) * width for e in range(len(ENGINES))]
        mine = [next(r for r in rows if r["engine"] == engine and r["mode"] == mode) for engine in ENGINES]
        speed.bar(positions, [1e3 / r["step_ms"] for r in mine], width, label=mode)
        memory.bar(positions, [r["resident_peak_mib"] for r in mine], width, label=mode)
        memory.scatter(positions, [r["allocated_peak_mib"] for r in mine], marker="_", s=150, color="black",
                       zorder=3, label="tensors' peak (allocator)" if offset == 0 else None)
    for axis in (speed, memory):
        axis.set_xticks(range(len(ENGINES)), ENGINES)
        axis.legend(fontsize=8)
    speed.set(title=f"steps/s (slowest rank, median of rounds)\n{description}", ylabel="steps/s")
    memory.set(title="resident set's peak growth per rank (libraries' pages aside), MiB", ylabel="MiB")
    for axis in (speed, memory):
        axis.title.set_fontsize(9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None, help="default 3; --quick 1")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 200; --quick 60)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    say_whether_pinned()
    config = dict(world=args.world, warmup=10, steps=args.steps or (60 if args.quick else 200))
    rounds = args.rounds or (1 if args.quick else 3)
    start = time.perf_counter()
    runs = []
    modes = list(MODES)
    for round_index in range(rounds):
        for engine in ENGINES:
            for mode in modes[round_index % len(modes):] + modes[:round_index % len(modes)]:
                runs.append(run(engine, mode, config))
                logger.info("round %d/%d, %s, %s: %.1f ms", round_index + 1, rounds, engine, mode,
                            runs[-1]["step_ms"])
    rows = summarise(runs)
    description = (f"{args.world} ranks, 5.3 M-parameter MLP, Adam, 32 samples per rank, {config['steps']} steps, "
                   f"{rounds} rounds")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "allocator.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "allocator.png", description)
    logger.info("%s\n\n%s\nwrote %s and %s in %.0f s", description, table(rows), args.out / "allocator.json",
                args.out / "allocator.png", time.perf_counter() - start)


if __name__ == "__main__":
    main()
