"""Collective latency and bus bandwidth: torchpar's "shm" backend beside torch's Gloo, in one run.

    python benchmarks/collectives.py [--worlds 2 3 4] [--max-bytes 64MiB] [--out benchmarks/results]

For each world size the script spawns that many ranks on this host; every rank joins a Gloo group
and an shm group, and each (op, size) is timed op by op on both, in alternating blocks, in the same
processes: the median (p50) and 90th percentile (p90) of the slowest rank. A plain memcpy of the same
size (one process, torch's copy_) is measured as the physical bound, and the same memcpy on every rank
at once (the slowest rank's median), the bound when the ranks share the memory bus, and a hand-over: rank 0
writes the bytes into shared memory and rank 1 copies them out (both copies' medians added): what moving
data between cores costs, which a 2-rank all-reduce does once per byte. Bus bandwidth follows nccl-tests
(from the median): allreduce algbw*2(n-1)/n, allgather algbw*(n-1)/n (size = output), broadcast algbw.
Sizes double from 4 KiB. Prints the table and the shm all-reduce's targets (no step in the latency
curve, a short tail, the speed-up over Gloo up to 1 MiB, bus bandwidth against memcpy at 16-64 MiB)
with which hold; writes <out>/collectives.json and collectives.png.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing
import os
import pathlib
import time

import torch
import torch.distributed as dist

from bench_ranks import free_port, say_whether_pinned
from torchpar.plan.cli import parse_bytes  # "64MiB", "4 KiB", "1000000"

logger = logging.getLogger("torchpar.bench")
OPS = ("allreduce", "broadcast", "allgather")
BACKENDS = ("gloo", "shm")
TARGET_SECONDS = 0.25  # per measurement (both backends' blocks together take about twice that)
BLOCKS = 3  # alternating blocks per backend
# The shm all-reduce's targets (issue 16): the largest time ratio per doubling of size, the largest p90 / p50,
# the smallest speed-up over Gloo's median up to SPEEDUP_UP_TO bytes, the smallest share of memcpy's bandwidth
# from BANDWIDTH_FROM bytes.
STEP_AT_MOST, TAIL_AT_MOST, SPEEDUP_AT_LEAST, BANDWIDTH_AT_LEAST = 2.2, 1.5, 10.0, 0.8
SPEEDUP_UP_TO, BANDWIDTH_FROM = 1 << 20, 16 << 20
# Beyond this the hand-over of one whole tensor goes through memory while the all-reduce moves 512 KiB rounds that
# stay in cache, so the hand-over stops being its reference.
HANDOVER_BOUND_UP_TO = 16 << 20


def sizes_up_to(max_bytes: int) -> list[int]:
    sizes, size = [], 4096
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


def bus_factor(op: str, world: int) -> float:
    return {"allreduce": 2 * (world - 1) / world, "allgather": (world - 1) / world, "broadcast": 1.0}[op]


def run_op(op, group, tensor, gathered):
    if op == "allreduce":
        dist.all_reduce(tensor, group=group)
    elif op == "broadcast":
        dist.broadcast(tensor, src=0, group=group)
    else:
        dist.all_gather_into_tensor(gathered, tensor, group=group)


def time_ops(op, group, tensor, gathered, control, iterations: int) -> list[float]:
    """Seconds of each of `iterations` ops on this rank (all ranks start together)."""
    for _ in range(2):
        run_op(op, group, tensor, gathered)
    dist.barrier(group=control)
    seconds = []
    for _ in range(iterations):
        start = time.perf_counter()
        run_op(op, group, tensor, gathered)
        seconds.append(time.perf_counter() - start)
    return seconds


def slowest_rank(values: list[float], control) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=control)
    return tensor.tolist()


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def memcpy_at_once_rows(world: int, sizes: list[int], control) -> list[dict]:
    """Every rank copying at once: the memory bandwidth each rank has while all of them move data."""
    rows = []
    for size in sizes:
        source, target = torch.ones(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
        target.copy_(source)
        iterations = max(5, int(TARGET_SECONDS / 4 * 4e9 / size))
        dist.barrier(group=control)
        seconds = []
        for _ in range(iterations):
            start = time.perf_counter()
            target.copy_(source)
            seconds.append(time.perf_counter() - start)
        median = slowest_rank([percentile(seconds, 0.5)], control)[0]
        rows.append(dict(op="memcpy", world=world, backend="memcpy", bytes=size, seconds=median,
                         busbw_gbps=size / median / 1e9))
    return rows


def handover_rows(world: int, sizes: list[int], shm_group, control, port: int) -> list[dict]:
    """Rank 0 writes the bytes into shared memory, then rank 1 copies them out: the time of both copies.

    Every shm collective is made of such hand-overs between cores, so this is the reference for its cost: a 2-rank
    all-reduce writes, on each rank, as many bytes for the other rank as it reads from it (its inputs' half and
    its results' half). The writer's copy pays for taking the cache lines back from the reader's cache, the
    reader's for fetching them from the writer's.
    """
    path = f"/dev/shm/torchpar-bench-handover-{port}"
    shared = torch.from_file(path, shared=True, size=max(sizes), dtype=torch.uint8)
    dist.barrier(group=control)
    if dist.get_rank() == 0:
        os.unlink(path)  # both ranks hold the mapping
    rows = []
    for size in sizes:
        source, target, window = (torch.ones(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8),
                                  shared[:size])
        iterations = max(5, min(300, int(TARGET_SECONDS / 4 * 4e9 / size)))
        seconds = []
        for _ in range(iterations + 2):
            for role, copy in ((0, lambda: window.copy_(source)), (1, lambda: target.copy_(window))):
                if dist.get_rank() == role:
                    start = time.perf_counter()
                    copy()
                    seconds.append(time.perf_counter() - start)
                dist.barrier(group=shm_group)
        median = percentile(seconds[2:], 0.5) if dist.get_rank() < 2 else 0.0
        total = torch.tensor([median], dtype=torch.float64)
        dist.all_reduce(total, group=control)
        rows.append(dict(op="handover", world=world, backend="memcpy", bytes=size, seconds=total.item(),
                         busbw_gbps=size / total.item() / 1e9))
    return rows


def rank_main(rank: int, world: int, port: int, sizes: list[int], results) -> None:
    import torchpar  # registers "shm"

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torchpar.init_process_group(backend="gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)  # after init_process_group: a pinned rank's share may hold more cores
    control = dist.new_group(backend="gloo")
    groups = {"gloo": dist.group.WORLD, "shm": dist.new_group(backend="shm")}
    rows = memcpy_at_once_rows(world, sizes, control) + handover_rows(world, sizes, groups["shm"], control, port)
    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=len(OPS) * len(sizes), desc=f"{world} ranks", unit="case")
    for op in OPS:
        for size in sizes:
            tensor = torch.ones(size // 4, dtype=torch.float32)
            gathered = torch.empty(world * tensor.numel(), dtype=torch.float32)
            # A short probe sets how many ops fill TARGET_SECONDS for each backend; the blocks then alternate.
            blocks = {}
            for backend in BACKENDS:
                probe = slowest_rank([sum(time_ops(op, groups[backend], tensor, gathered, control, 5)) / 5],
                                     control)[0]
                blocks[backend] = max(10, min(5000, int(TARGET_SECONDS / BLOCKS / max(probe, 1e-7))))
            samples = {backend: [] for backend in BACKENDS}
            for _ in range(BLOCKS):
                for backend in BACKENDS:
                    samples[backend] += time_ops(op, groups[backend], tensor, gathered, control, blocks[backend])
            for backend in BACKENDS:
                median, p90 = slowest_rank([percentile(samples[backend], 0.5), percentile(samples[backend], 0.9)],
                                           control)
                data = size * (world if op == "allgather" else 1)
                rows.append(dict(op=op, world=world, backend=backend, bytes=size, seconds=median, p90_seconds=p90,
                                 busbw_gbps=data / median * bus_factor(op, world) / 1e9))
            if progress:
                progress.update()
    if progress:
        progress.close()
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def memcpy_rows(sizes: list[int]) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for size in sizes:
        source, target = torch.ones(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
        target.copy_(source)
        iterations = max(3, int(TARGET_SECONDS * 4e9 / size))
        start = time.perf_counter()
        for _ in range(iterations):
            target.copy_(source)
        seconds = (time.perf_counter() - start) / iterations
        rows.append(dict(op="memcpy", world=1, backend="memcpy", bytes=size, seconds=seconds,
                         busbw_gbps=size / seconds / 1e9))
    return rows


def table(rows: list[dict]) -> str:
    index = {(r["op"], r["world"], r["backend"], r["bytes"]): r for r in rows}
    lines = ["| op | ranks | size | gloo p50 | gloo p90 | shm p50 | shm p90 | speed-up (p50) | gloo busbw | shm busbw "
             "| memcpy | memcpy, every rank at once | hand-over between ranks |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for op in OPS:
        for world in sorted({r["world"] for r in rows if r["op"] == op}):
            for size in sorted({r["bytes"] for r in rows if r["op"] == op}):
                gloo, shm = index[(op, world, "gloo", size)], index[(op, world, "shm", size)]
                lines.append(
                    f"| {op} | {world} | {human(size)} | {gloo['seconds'] * 1e6:.0f} µs "
                    f"| {gloo['p90_seconds'] * 1e6:.0f} µs "
                    f"| {shm['seconds'] * 1e6:.1f} µs | {shm['p90_seconds'] * 1e6:.1f} µs "
                    f"| {gloo['seconds'] / shm['seconds']:.1f}x | {gloo['busbw_gbps']:.2f} GB/s "
                    f"| {shm['busbw_gbps']:.2f} GB/s | {index[('memcpy', 1, 'memcpy', size)]['busbw_gbps']:.2f} GB/s "
                    f"| {index[('memcpy', world, 'memcpy', size)]['busbw_gbps']:.2f} GB/s "
                    f"| {index[('handover', world, 'memcpy', size)]['busbw_gbps']:.2f} GB/s |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[dict]:
    """The shm all-reduce's targets per world size: what was measured, and whether it holds."""
    memcpy = {r["bytes"]: r["busbw_gbps"] for r in rows if (r["op"], r["world"]) == ("memcpy", 1)}
    checks = []
    for world in sorted({r["world"] for r in rows if r["op"] == "allreduce"}):
        shm = sorted((r for r in rows if (r["op"], r["world"], r["backend"]) == ("allreduce", world, "shm")),
                     key=lambda r: r["bytes"])
        gloo = {r["bytes"]: r for r in rows if (r["op"], r["world"], r["backend"]) == ("allreduce", world, "gloo")}
        steps = [(b["seconds"] / a["seconds"], b["bytes"]) for a, b in zip(shm, shm[1:])]
        tails = [(r["p90_seconds"] / r["seconds"], r["bytes"]) for r in shm]
        speedups = [(gloo[r["bytes"]]["seconds"] / r["seconds"], r["bytes"]) for r in shm
                    if r["bytes"] <= SPEEDUP_UP_TO]
        shares = [(r["busbw_gbps"] / memcpy[r["bytes"]], r["bytes"]) for r in shm if r["bytes"] >= BANDWIDTH_FROM]
        # Where the hand-over between two cores, the 2-rank all-reduce's reference, would meet the target itself.
        handover = {r["bytes"]: r for r in rows if (r["op"], r["world"]) == ("handover", world)} if world == 2 else {}
        bound_speedups = [(gloo[size]["seconds"] / handover[size]["seconds"], size) for _, size in speedups
                          if size in handover]
        bound_shares = [(handover[size]["busbw_gbps"] / memcpy[size], size) for _, size in shares
                        if size in handover and size <= HANDOVER_BOUND_UP_TO]
        for name, values, worst, holds, bound in (
                (f"time per doubling of size <= {STEP_AT_MOST}x", steps, max,
                 lambda v: v <= STEP_AT_MOST, []),
                (f"p90 <= {TAIL_AT_MOST}x p50", tails, max, lambda v: v <= TAIL_AT_MOST, []),
                (f">= {SPEEDUP_AT_LEAST:.0f}x Gloo's median up to {human(SPEEDUP_UP_TO)}", speedups, min,
                 lambda v: v >= SPEEDUP_AT_LEAST, bound_speedups),
                (f"busbw >= {BANDWIDTH_AT_LEAST:.0%} of memcpy from {human(BANDWIDTH_FROM)}", shares, min,
                 lambda v: v >= BANDWIDTH_AT_LEAST, bound_shares)):
            if not values:
                continue
            value, size = worst(values)
            checks.append(dict(world=world, target=name, worst=value, at_bytes=size, holds=holds(value),
                               held=sum(holds(v) for v, _ in values), of=len(values),
                               bound_held=sum(holds(v) for v, _ in bound) if bound else None,
                               bound_of=len(bound)))
    return checks


def against_handover(rows: list[dict]) -> str:
    """2 ranks: the all-reduce's time over the hand-over of the same bytes, its reference (see handover_rows)."""
    handover = {r["bytes"]: r["seconds"] for r in rows if (r["op"], r["world"]) == ("handover", 2)}
    shm = sorted((r for r in rows if (r["op"], r["world"], r["backend"]) == ("allreduce", 2, "shm")),
                 key=lambda r: r["bytes"])
    if not shm or not handover:
        return ""
    lines = ["| size | shm all-reduce, 2 ranks | hand-over of the same bytes | all-reduce / hand-over |",
             "| ---: | ---: | ---: | ---: |"]
    for r in shm:
        lines.append(f"| {human(r['bytes'])} | {r['seconds'] * 1e6:.1f} µs | {handover[r['bytes']] * 1e6:.1f} µs "
                     f"| {r['seconds'] / handover[r['bytes']]:.2f} |")
    return "\n".join(lines)


def targets_table(checks: list[dict]) -> str:
    lines = ["| ranks | shm all-reduce target | worst measured | at | sizes holding | holds "
             "| sizes where the hand-over itself holds |",
             "| ---: | --- | ---: | ---: | ---: | --- | ---: |"]
    for c in checks:
        bound = f"{c['bound_held']} of {c['bound_of']}" if c.get("bound_held") is not None else "—"
        lines.append(f"| {c['world']} | {c['target']} | {c['worst']:.2f} | {human(c['at_bytes'])} "
                     f"| {c['held']} of {c['of']} | {'yes' if c['holds'] else 'no'} | {bound} |")
    return "\n".join(lines)


def human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in rows if r["op"] != "memcpy"})
    figure, axes = plt.subplots(2, len(OPS), figsize=(5 * len(OPS), 8), squeeze=False)
    memcpy = {world: sorted((r for r in rows if (r["op"], r["world"]) == ("memcpy", world)), key=lambda r: r["bytes"])
              for world in [1] + worlds}
    for column, op in enumerate(OPS):
        latency, bandwidth = axes[0][column], axes[1][column]
        for world in worlds:
            for backend, style in (("gloo", "--"), ("shm", "-")):
                series = sorted((r for r in rows if (r["op"], r["world"], r["backend"]) == (op, world, backend)),
                                key=lambda r: r["bytes"])
                sizes = [r["bytes"] for r in series]
                label = f"{backend}, {world} ranks"
                line, = latency.plot(sizes, [r["seconds"] * 1e6 for r in series], style, marker="o",
                                     label=label + " (p50; band to p90)")
                latency.fill_between(sizes, [r["seconds"] * 1e6 for r in series],
                                     [r["p90_seconds"] * 1e6 for r in series], color=line.get_color(), alpha=0.15)
                bandwidth.plot(sizes, [r["busbw_gbps"] for r in series], style, marker="o", label=label)
        handover = sorted((r for r in rows if (r["op"], r["world"]) == ("handover", 2)), key=lambda r: r["bytes"])
        if handover and op == "allreduce":
            bandwidth.plot([r["bytes"] for r in handover], [r["busbw_gbps"] for r in handover], "-.", color="gray",
                           label="hand-over between 2 ranks (write + read)")
        for world, series in memcpy.items():
            bandwidth.plot([r["bytes"] for r in series], [r["busbw_gbps"] for r in series], ":",
                           color="black" if world == 1 else None,
                           label="memcpy (1 core)" if world == 1 else f"memcpy, each of {world} ranks at once")
        latency.set(title=f"{op}: latency", xscale="log", yscale="log", ylabel="µs per op", xlabel="bytes")
        bandwidth.set(title=f"{op}: bus bandwidth", xscale="log", ylabel="GB/s", xlabel="bytes")
        latency.legend(fontsize=8)
        bandwidth.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("64MiB"))
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    say_whether_pinned()
    sizes = sizes_up_to(args.max_bytes)
    rows = memcpy_rows(sizes)
    context = multiprocessing.get_context("spawn")
    for world in args.worlds:
        results = context.Queue()
        port = free_port()
        ranks = [context.Process(target=rank_main, args=(rank, world, port, sizes, results)) for rank in range(world)]
        for process in ranks:
            process.start()
        rows.extend(results.get(timeout=3600))
        for process in ranks:
            process.join()
            if process.exitcode != 0:
                raise SystemExit(f"a rank of the {world}-rank run failed (exit code {process.exitcode})")
    args.out.mkdir(parents=True, exist_ok=True)
    checks = targets(rows)
    (args.out / "collectives.json").write_text(json.dumps(dict(rows=rows, targets=checks), indent=1))
    plot(rows, args.out / "collectives.png")
    logger.info("%s\n\n%s\n\n%s\n\nwrote %s and %s", table(rows), targets_table(checks), against_handover(rows),
                args.out / "collectives.json", args.out / "collectives.png")


if __name__ == "__main__":
    main()
