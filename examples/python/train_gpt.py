"""Trains a small GPT (a decoder-only transformer over bytes) on Python's own docstrings with 3-D
parallelism: data x pipeline x tensor.

    python3 scripts/export_text.py                     # once (scripts/setup.sh does it): data/docstrings.txt
    torchrun --nproc-per-node=8 examples/python/train_gpt.py --data-parallel 2 --pipeline 2 --tensor 2
    torchrun --nproc-per-node=2 examples/python/train_gpt.py --tensor 2 --backend shm
    torchrun --nproc-per-node=4 examples/python/train_gpt.py --pipeline 2      # 2 data-parallel replicas inferred
    python3 examples/python/train_gpt.py               # one process: the same loss curve

The model: a vocabulary-parallel token embedding (plus replicated positions), --layers pre-LayerNorm
blocks whose attention heads are split over the tensor group (query, key and value projections
column-parallel, the output projection row-parallel) and whose MLP is column -> GELU -> row, then a final
LayerNorm and a column-parallel head whose logits stay split over the vocabulary: the loss is
torchpar's vocabulary-parallel cross-entropy, which never gathers them. The layers are cut evenly into
--pipeline stages (1F1B over --microbatches micro-batches), and each of the --data-parallel replicas
trains on its share of every batch, the replicas averaging their gradients.

Every layer is built from its own seed and every tensor-parallel layer keeps its slice of the full
layer, so the weights do not depend on the grid; gradients are clipped over the whole model
(torchpar.tensor_parallel.clip_grad_norm_), and there is no dropout: any grid of the same global batch
trains the same model, and the loss curve equals the one-process run's up to float rounding
(--losses writes it). Exit code 0; 1 if the loss did not fall; 2 for a wrong launch or options.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import pathlib
import sys
import time

import torch
import torch._dynamo  # noqa: F401  (before the process group exists: see train_pipeline.py)
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchpar
import torchpar.pipeline
import torchpar.tensor_parallel as tp

logger = logging.getLogger("torchpar.examples.train_gpt")
DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "docstrings.txt"
VOCAB = 128  # printable ASCII: one byte, one token


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, default=DATA, help="written by scripts/export_text.py")
    parser.add_argument("--data-parallel", type=int, default=None, metavar="D",
                        help="replicas (default: the world's ranks / (pipeline x tensor), as torchtitan infers it)")
    parser.add_argument("--pipeline", type=int, default=1, metavar="P", help="pipeline stages")
    parser.add_argument("--tensor", type=int, default=1, metavar="T", help="tensor-parallel size")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step, over all replicas")
    parser.add_argument("--microbatches", type=int, default=2, help="per replica and step")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's, after a warm-up, cosine decay")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["gloo", "shm"], default=None,
                        help="the grid's process groups (default: $TORCHPAR_BACKEND, else gloo)")
    parser.add_argument("--losses", type=pathlib.Path, default=None, help="write the loss of every step (JSON)")
    return parser.parse_args()


def check_args(args: argparse.Namespace, world: int) -> str | None:
    """What is wrong with the options for this world, or None; infers --data-parallel when it is not given."""
    if args.data_parallel is None:
        if world % (args.pipeline * args.tensor):
            return (f"the world's {world} ranks do not divide into --pipeline {args.pipeline} x --tensor "
                    f"{args.tensor} (the data-parallel size is inferred from them)")
        args.data_parallel = world // (args.pipeline * args.tensor)
    grid = args.data_parallel * args.pipeline * args.tensor
    if grid != world:
        return (f"--data-parallel {args.data_parallel} x --pipeline {args.pipeline} x --tensor {args.tensor} = "
                f"{grid}, but the world has {world} ranks")
    if args.layers + 2 < args.pipeline:
        return f"--layers {args.layers} (+ embedding and head) gives fewer layers than the {args.pipeline} stages"
    if args.heads % args.tensor or args.width % args.heads:
        return f"--heads {args.heads} must divide --width {args.width} and divide by --tensor {args.tensor}"
    if args.batch_size % (args.data_parallel * args.microbatches):
        return (f"--batch-size {args.batch_size} does not split into {args.data_parallel} replica(s) x "
                f"{args.microbatches} micro-batches")
    return None


class Embedding(nn.Module):
    """Token rows split over the vocabulary (tensor group), positions replicated."""

    def __init__(self, width: int, context: int, tensor: dist.ProcessGroup):
        super().__init__()
        self.tokens = tp.VocabParallelEmbedding(VOCAB, width, group=tensor, name="embedding.tokens")
        self.positions = nn.Embedding(context, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention and MLP; this rank holds heads / T heads and 4 * width / T of
    the MLP's hidden features."""

    def __init__(self, width: int, heads: int, tensor: dist.ProcessGroup, name: str):
        super().__init__()
        column = lambda i, o, what: tp.ColumnParallelLinear(i, o, group=tensor, name=f"{name}.{what}")
        row = lambda i, o, what: tp.RowParallelLinear(i, o, group=tensor, name=f"{name}.{what}")
        self.heads, self.head_width = heads // tensor.size(), width // heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.query, self.key, self.value = column(width, width, "query"), column(width, width, "key"), column(
            width, width, "value")
        self.out = row(width, width, "out")
        self.up, self.down = column(width, 4 * width, "up"), row(4 * width, width, "down")

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        split = lambda t: t.view(b, s, self.heads, self.head_width).transpose(1, 2)
        mixed = F.scaled_dot_product_attention(split(self.query(h)), split(self.key(h)), split(self.value(h)),
                                               is_causal=True)
        return self.out(mixed.transpose(1, 2).reshape(b, s, self.heads * self.head_width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Head(nn.Module):
    """The final LayerNorm and the logits, left split over the vocabulary."""

    def __init__(self, width: int, tensor: dist.ProcessGroup):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.logits = tp.ColumnParallelLinear(width, VOCAB, bias=False, group=tensor, name="head")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.norm(x))


def layer_factories(args: argparse.Namespace, tensor: dist.ProcessGroup) -> list:
    """One factory per pipeline layer; each seeds itself, so a layer's weights do not depend on the grid."""
    def seeded(index: int, build):
        def factory():
            torch.manual_seed(args.seed * 1000 + index)
            return build()
        return factory

    builders = [lambda: Embedding(args.width, args.context, tensor)]
    builders += [lambda i=i: Block(args.width, args.heads, tensor, f"block{i}") for i in range(args.layers)]
    builders += [lambda: Head(args.width, tensor)]
    return [seeded(index, build) for index, build in enumerate(builders)]


def mean_loss(logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The mean next-byte loss from logits split over the vocabulary, without gathering them."""
    return tp.vocab_parallel_cross_entropy(logits, targets, group)


def even_balance(layers: int, stages: int) -> list[int]:
    """Layers per stage, as even as counts allow. Given explicitly: balancing by parameters or time would
    build every layer on every rank, and a tensor-parallel layer's constructor is collective."""
    return [layers // stages + (stage < layers % stages) for stage in range(stages)]


def windows(text: torch.Tensor, count: int, context: int, generator: torch.Generator) -> tuple:
    """`count` random windows of context + 1 bytes: inputs and next-byte targets."""
    starts = torch.randint(0, len(text) - context - 1, (count,), generator=generator)
    rows = torch.stack([text[start:start + context + 1] for start in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def learning_rate(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def main() -> int:
    args = parse_args()
    try:
        if "RANK" in os.environ:  # under torchrun
            torchpar.init_process_group(backend=args.backend)
        else:  # one process on its own
            torchpar.init_process_group(backend=args.backend, rank=0, world_size=1, store=dist.HashStore())
    except torchpar.LaunchError as error:
        print(f"train_gpt.py: {error}", file=sys.stderr)
        return 2
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    logging.getLogger("torchpar.pipeline").setLevel(logging.WARNING)
    problem = check_args(args, world)
    if problem is None and not args.data.is_file():
        problem = f"{args.data} not found; write it with `python3 scripts/export_text.py`"
    if problem is not None:
        if rank == 0:
            print(f"train_gpt.py: {problem}", file=sys.stderr)
        dist.destroy_process_group()
        return 2

    text = torch.frombuffer(bytearray(args.data.read_bytes()), dtype=torch.uint8).long()
    held_out_from = len(text) * 9 // 10
    train_text, held_out_text = text[:held_out_from], text[held_out_from:]
    grid = torchpar.ParallelGrid(data=args.data_parallel, pipeline=args.pipeline, tensor=args.tensor,
                                 backend=args.backend or "")
    tensor = grid.tensor_group
    factories = layer_factories(args, tensor)
    pipe = torchpar.pipeline.Pipeline(
        factories, functools.partial(mean_loss, group=tensor),
        microbatches=args.microbatches, schedule="1f1b", balance=even_balance(len(factories), args.pipeline),
        process_group=grid.pipeline_group, data_parallel_group=grid.data_group)
    model = nn.ModuleDict(pipe.stage_modules)  # this rank's stages
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    parameters = sum(p.numel() for p in model.parameters())
    logger.info("GPT: %d blocks, width %d, %d heads, context %d, vocabulary %d; %d ranks = %d data x %d pipeline "
                "x %d tensor, backend %s; rank 0 holds %d parameters", args.layers, args.width, args.heads,
                args.context, VOCAB, world, args.data_parallel, args.pipeline, args.tensor,
                args.backend or os.environ.get("TORCHPAR_BACKEND", "gloo"), parameters)

    from tqdm import tqdm

    share = args.batch_size // args.data_parallel
    mine = slice(grid.data_index * share, (grid.data_index + 1) * share)
    generator = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    losses = []
    start = time.perf_counter()
    progress = tqdm(range(args.steps), desc="train", unit="step", disable=rank != 0)
    for step in progress:
        inputs, targets = windows(train_text, args.batch_size, args.context, generator)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr)
        optimizer.zero_grad()
        # The replicas' mean losses, averaged: the global batch's.
        loss = pipe.step(inputs[mine], targets[mine]).reshape(1)
        grid.data_group.allreduce([loss]).wait()
        tp.clip_grad_norm_(model, args.clip, tensor_group=tensor, pipeline_group=grid.pipeline_group)
        optimizer.step()
        losses.append(float(loss) / args.data_parallel)
        progress.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    seconds = time.perf_counter() - start

    # Held-out loss: every replica runs the same windows; the last stage's ranks score them.
    model.eval()
    inputs, targets = windows(held_out_text, 32, args.context, torch.Generator().manual_seed(args.seed + 1))
    held_out = torch.tensor([-math.inf])
    logits = pipe.forward(inputs)
    if pipe.is_last_stage:
        held_out.fill_(float(mean_loss(logits, targets, tensor)))
    dist.all_reduce(held_out, op=dist.ReduceOp.MAX)
    first, last = sum(losses[:10]) / len(losses[:10]), sum(losses[-10:]) / len(losses[-10:])
    if rank == 0:
        print(f"train_gpt: {world} ranks = {args.data_parallel} data x {args.pipeline} pipeline x {args.tensor} "
              f"tensor, {args.steps} steps in {seconds:.1f} s ({args.steps * args.batch_size / seconds:.1f} "
              f"sequences/s), loss {first:.3f} -> {last:.3f} (first and last 10 steps), held-out loss "
              f"{float(held_out):.3f}", flush=True)
        if args.losses is not None:
            args.losses.write_text(json.dumps(losses))
    del pipe, model, optimizer, grid, tensor
    dist.destroy_process_group()
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
