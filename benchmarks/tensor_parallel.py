"""Tensor parallelism: one transformer block split over 2 ranks, torchpar's layers beside torch's own
(torch.distributed.tensor.parallel), and beside one process computing the whole block.

    python benchmarks/tensor_parallel.py [--widths 128 256 512 1024] [--tokens 256] [--quick]
                                         [--out benchmarks/results]

Two ranks are spawned on this host (one thread each). Per width, every rank builds from the same seed:

    one process   the whole block on rank 0 alone with 1 thread (rank 1 waits): what one core does
                  without tensor parallelism (and "2 threads": the same process allowed both cores)
    torch         torch's tensor parallelism: parallelize_module with ColwiseParallel (query, key, value,
                  MLP up) and RowwiseParallel (output projection, MLP down) on a DeviceMesh over Gloo
    torchpar      torchpar.tensor_parallel's ColumnParallelLinear / RowParallelLinear, on Gloo and on
                  torchpar's shm backend

The block: pre-LayerNorm self-attention (width / 64 heads, split over the ranks) and an MLP of 4 x width,
on --tokens tokens (batch 4). A step is forward, a squared-error loss, backward and an SGD step. Before
timing, every variant's output and input gradient are checked against the whole block's. Variants run
alternately in the same processes, in rounds (order rotating); a measurement is the slowest rank's time;
a rate is the median over rounds and each ratio the median of per-round ratios.

Writes <out>/tensor_parallel.json and tensor_parallel.png and prints the table: samples/s (a sample is a
sequence of 64 tokens), torchpar/torch on Gloo (target >= 1), torchpar on shm against one process (target:
> 1 once the block is wide enough that compute dominates) and the width where it crosses.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bench_ranks import join_world, run_world

logger = logging.getLogger("torchpar.bench")
WORLD = 2
SEQUENCE = 64
HEAD_WIDTH = 64
LR = 1e-3
WARMUP_STEPS = 3
CLEARLY_FASTER = 1.05  # ratios within 5% of 1 are parity on this machine
VARIANTS = ("one process", "2 threads", "torch gloo", "torchpar gloo", "torchpar shm")


class Block(nn.Module):
    """Pre-LayerNorm attention + MLP. `column`/`row` build the split layers (nn.Linear for the whole block
    and for torch's parallelize_module, which splits them afterwards); `heads` is this rank's."""

    def __init__(self, width: int, heads: int, column=nn.Linear, row=nn.Linear):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.query, self.key, self.value = column(width, width), column(width, width), column(width, width)
        self.out = row(width, width)
        self.up, self.down = column(width, 4 * width), row(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        split = lambda t: t.view(b, s, self.heads, HEAD_WIDTH).transpose(1, 2)
        h = self.norm1(x)
        mixed = F.scaled_dot_product_attention(split(self.query(h)), split(self.key(h)), split(self.value(h)))
        x = x + self.out(mixed.transpose(1, 2).reshape(b, s, self.heads * HEAD_WIDTH))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Variant:
    def __init__(self, name: str, module: nn.Module, x: torch.Tensor, target: torch.Tensor, alone: bool = False):
        self.name, self.module, self.x, self.target, self.alone = name, module, x, target, alone
        self.optimizer = torch.optim.SGD(module.parameters(), lr=LR)
        self.steps = 0
        self.rates: list[float] = []

    def step(self) -> None:
        self.optimizer.zero_grad()
        F.mse_loss(self.module(self.x), self.target).backward()
        self.optimizer.step()


def timed(variant: Variant, control, rank: int, steps: int) -> float:
    """Samples/s of the slowest rank over `steps` steps (rank 0 alone for the one-process variants)."""
    dist.barrier(group=control)
    start = time.perf_counter()
    if not variant.alone or rank == 0:
        for _ in range(steps):
            variant.step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=control)
    return steps * variant.x.shape[0] / elapsed.item()


def check_against_whole(variant: Variant, whole: nn.Module, x: torch.Tensor, width: int) -> None:
    """The split block computes the whole block's output and input gradient (float32 tolerance)."""
    expected_input = x.clone().requires_grad_()
    expected = whole(expected_input)
    expected.square().sum().backward()
    mine = x.clone().requires_grad_()
    output = variant.module(mine)
    output.square().sum().backward()
    for what, a, b in (("output", output, expected), ("input gradient", mine.grad, expected_input.grad)):
        if not torch.allclose(a, b, rtol=1e-3, atol=1e-3):
            raise RuntimeError(f"{variant.name}, width {width}: the {what} differs from the whole block's by "
                               f"{(a - b).abs().max():.3g}")
    variant.module.zero_grad(set_to_none=True)


def rank_main(rank: int, world: int, port: int, config: dict, results) -> None:
    import torchpar.tensor_parallel as tp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    control, groups = join_world(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    plan = {"query": ColwiseParallel(), "key": ColwiseParallel(), "value": ColwiseParallel(),
            "out": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=len(config["widths"]) * len(VARIANTS) * config["rounds"], desc="runs", unit="run")
    rows = []
    for width in config["widths"]:
        heads = width // HEAD_WIDTH
        batch = config["tokens"] // SEQUENCE
        generator = torch.Generator().manual_seed(width)
        x = torch.randn(batch, SEQUENCE, width, generator=generator)
        target = torch.randn(batch, SEQUENCE, width, generator=generator)
        torch.manual_seed(0)
        whole = Block(width, heads)
        split_heads = heads // world
        torch_tp = parallelize_module(copy.deepcopy(whole), mesh, plan)
        torch_tp.heads = split_heads
        variants = [Variant("one process", copy.deepcopy(whole), x, target, alone=True),
                    Variant("2 threads", copy.deepcopy(whole), x, target, alone=True),
                    Variant("torch gloo", torch_tp, x, target)]
        for backend in ("gloo", "shm"):
            torch.manual_seed(0)  # the same draws as the whole block's: the same weights, split
            module = Block(width, split_heads, column=lambda i, o: tp.ColumnParallelLinear(i, o, group=groups[backend]),
                           row=lambda i, o: tp.RowParallelLinear(i, o, group=groups[backend]))
            variants.append(Variant(f"torchpar {backend}", module, x, target))
        for variant in variants[2:]:
            check_against_whole(variant, whole, x, width)
        for variant in variants:
            torch.set_num_threads(2 if variant.name == "2 threads" else 1)
            for _ in range(WARMUP_STEPS):
                if not variant.alone or rank == 0:
                    variant.step()
            probe = timed(variant, control, rank, 2) / batch  # steps/s of the slowest rank: equal on every rank
            variant.steps = max(2, min(1000, int(config["seconds"] * probe)))
        for round_index in range(config["rounds"]):
            shift = round_index % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                torch.set_num_threads(2 if variant.name == "2 threads" else 1)
                variant.rates.append(timed(variant, control, rank, variant.steps))
                if progress:
                    progress.update()
        torch.set_num_threads(1)
        by_name = {v.name: v for v in variants}
        per_round = lambda a, b: statistics.median(x / y for x, y in zip(by_name[a].rates, by_name[b].rates))
        rows.append(dict(
            width=width, tokens=config["tokens"], parameters=sum(p.numel() for p in whole.parameters()),
            samples_per_s={v.name: statistics.median(v.rates) for v in variants},
            rounds={v.name: v.rates for v in variants},
            torchpar_gloo_over_torch=per_round("torchpar gloo", "torch gloo"),
            torchpar_shm_over_torch=per_round("torchpar shm", "torch gloo"),
            shm_over_one_process=per_round("torchpar shm", "one process"),
            shm_over_2_threads=per_round("torchpar shm", "2 threads")))
    if progress:
        progress.close()
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def crossover(rows: list[dict]) -> str:
    """The narrowest width from which torchpar on shm beats one process (by more than the harness's noise)
    at every wider width."""
    faster = [r["shm_over_one_process"] > CLEARLY_FASTER for r in rows]
    for index in range(len(rows)):
        if all(faster[index:]):
            return f"width {rows[index]['width']}" if index else f"width {rows[0]['width']} or less"
    return "not within the widths measured"


def table(rows: list[dict]) -> str:
    lines = ["| width | parameters | one process | 2 threads | torch gloo | torchpar gloo | torchpar shm "
             "| torchpar/torch (gloo) | shm/torch gloo | shm/one process | shm/2 threads |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        rates = " | ".join(f"{r['samples_per_s'][name]:.1f}" for name in VARIANTS)
        lines.append(f"| {r['width']} | {r['parameters'] / 1e6:.2f} M | {rates} | {r['torchpar_gloo_over_torch']:.2f} "
                     f"| {r['torchpar_shm_over_torch']:.2f} | {r['shm_over_one_process']:.2f} "
                     f"| {r['shm_over_2_threads']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rates, ratios) = plt.subplots(1, 2, figsize=(11, 4.2))
    widths = [r["width"] for r in rows]
    for name, style in zip(VARIANTS, ("k-", "k:", "b-o", "C1-o", "C1--s")):
        rates.plot(widths, [r["samples_per_s"][name] for r in rows], style, label=name)
    rates.set(xscale="log", yscale="log", xlabel="block width", ylabel="samples/s (slowest rank)",
              title=f"one transformer block, {rows[0]['tokens']} tokens per step, 2 ranks")
    rates.set_xticks(widths, [str(w) for w in widths])
    for key, label, style in (("torchpar_gloo_over_torch", "torchpar gloo / torch gloo", "C1-o"),
                              ("shm_over_one_process", "torchpar shm / one process", "C1--s"),
                              ("shm_over_2_threads", "torchpar shm / one process, 2 threads", "C2--^")):
        ratios.plot(widths, [r[key] for r in rows], style, label=label)
    ratios.axhline(1.0, color="gray", lw=0.8)
    ratios.set(xscale="log", xlabel="block width", ylabel="ratio of samples/s", title="ratios (median of rounds)")
    ratios.set_xticks(widths, [str(w) for w in widths])
    for axis in (rates, ratios):
        axis.minorticks_off()
        axis.legend(fontsize=8)
        axis.title.set_fontsize(9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=None,
                        help="block widths, multiples of 128 (default 128 256 512 1024; --quick 128 512)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per step (sequences of 64)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant (default 7; --quick 3)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="target seconds per timed run (default 0.6; --quick 0.2)")
    parser.add_argument("--quick", action="store_true", help="a sanity run of about a minute")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Unpinned: the "2 threads" variant is one process on both cores.
    os.environ["TORCHPAR_BIND_CORES"] = "0"
    widths = args.widths or ([128, 512] if args.quick else [128, 256, 512, 1024])
    bad = [w for w in widths if w % (HEAD_WIDTH * WORLD)]
    if bad or args.tokens % SEQUENCE:
        parser.error(f"widths must be multiples of {HEAD_WIDTH * WORLD} and --tokens of {SEQUENCE}")
    config = dict(widths=widths, tokens=args.tokens, rounds=args.rounds or (3 if args.quick else 7),
                  seconds=args.seconds or (0.2 if args.quick else 0.6))
    start = time.perf_counter()
    rows = run_world(WORLD, rank_main, config)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tensor_parallel.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "tensor_parallel.png")
    gloo = [r["torchpar_gloo_over_torch"] for r in rows]
    logger.info("%s\n\ntorchpar/torch on gloo: lowest %.2f, median %.2f (target >= 1.00)\n"
                "torchpar on shm faster than one process (> %.2fx) from: %s\nwrote %s and %s in %.0f s",
                table(rows), min(gloo), statistics.median(gloo), CLEARLY_FASTER, crossover(rows),
                args.out / "tensor_parallel.json", args.out / "tensor_parallel.png", time.perf_counter() - start)


if __name__ == "__main__":
    main()
