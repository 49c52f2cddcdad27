"""Trains a deep MLP on the 8x8 digits with torchpar's pipeline parallelism, then tests it.

    python3 scripts/export_digits.py                  # once (scripts/setup.sh does it): data/digits.pt
    torchrun --nproc-per-node=2 examples/python/train_pipeline.py
    torchrun --nproc-per-node=4 examples/python/train_pipeline.py --schedule interleaved --virtual-stages 2
    torchrun --nproc-per-node=4 examples/python/train_pipeline.py --schedule zero_bubble --balance time
    torchrun --nproc-per-node=4 examples/python/train_pipeline.py --data-parallel 2   # 2 replicas x 2 stages
    torchrun --nproc-per-node=2 --max-restarts=3 examples/python/train_pipeline.py --checkpoint-dir ckpt

The MLP (64-128-...-128-10, --depth Linear layers, each but the last followed by a ReLU) is cut into
one stage per rank (times --virtual-stages for the interleaved schedule); each rank builds an
optimizer over its own stages' parameters only. Every step feeds the same batch to the first stage
and its labels to the last; the schedule runs the micro-batches through the stages, forward and
backward, and the gradients accumulate on the ranks owning the layers. With --data-parallel N the
world holds N pipeline replicas, each training on its own share of every batch; the replicas average
their gradients at the end of each step, so the weights stay identical.

At the end the last stage's rank scores the held-out set (pipe.forward) and prints
"train_pipeline: ... test accuracy 97.2%", the mean step time (the steps alone, the data handling aside) and the
fullest rank's peak tensor memory (torchpar.allocator.TensorPeak). Exit code: 0, or 1 when the accuracy is below 95% (on
every rank), or 2 for a wrong launch, wrong options or missing data.

With --checkpoint-dir every rank saves its own stages, optimizer, learning-rate schedule and position every
--checkpoint-every steps and at the end; started again it resumes from the newest complete checkpoint.
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import time

import torch
import torch._dynamo  # noqa: F401  (before the process group exists: see the end of main)
import torch.distributed as dist
from torch import nn

import torchpar
import torchpar.pipeline

logger = logging.getLogger("torchpar.examples.train_pipeline")
DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "digits.pt"
TARGET_ACCURACY = 0.95


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, default=DATA, help="written by scripts/export_digits.py")
    parser.add_argument("--schedule", choices=torchpar.pipeline.SCHEDULES, default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (per replica)")
    parser.add_argument("--virtual-stages", type=int, default=None,
                        help="stages per rank (interleaved only; default 2 for interleaved, else 1)")
    parser.add_argument("--balance", choices=["uniform", "parameters", "time"], default="uniform",
                        help="how layers are spread over the stages")
    parser.add_argument("--checkpoint", action="store_true",
                        help="recompute each stage's forward in backward instead of keeping activations")
    parser.add_argument("--data-parallel", type=int, default=1, metavar="N",
                        help="N pipeline replicas of world/N stages each")
    parser.add_argument("--depth", type=int, default=8, help="Linear layers in the MLP")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="samples per step, over all replicas (divisible by replicas x micro-batches)")
    parser.add_argument("--lr", type=float, default=0.03, help="initial; cosine decay to 0 over the run")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--backend", choices=["gloo", "shm"], default=None,
                        help="process-group backend (default: $TORCHPAR_BACKEND, else gloo)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=None,
                        help="save checkpoints here and resume from the newest one (a folder every rank sees)")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    return parser.parse_args()


def check_args(args: argparse.Namespace, world: int) -> str | None:
    """What is wrong with the options for this world, or None."""
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule == "interleaved" else 1
    if args.data_parallel < 1 or world % args.data_parallel:
        return f"--data-parallel {args.data_parallel} does not divide the world of {world} ranks"
    stages = world // args.data_parallel * args.virtual_stages
    if args.depth < stages:
        return f"--depth {args.depth} gives fewer layers than the {stages} stages"
    if args.batch_size % (args.data_parallel * args.microbatches):
        return (f"--batch-size {args.batch_size} does not split into {args.data_parallel} replica(s) x "
                f"{args.microbatches} micro-batches")
    return None


def mlp_layers(depth: int, hidden: int) -> list[nn.Module]:
    """The pipeline's layers: Linear+ReLU blocks, then the classifier (a layer is the unit of balancing).
    He initialisation: with PyTorch's default one the signal fades through 8 layers and SGD stalls."""
    widths = [64] + [hidden] * (depth - 1)
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])]
    layers = blocks + [nn.Linear(hidden, 10)]
    for module in nn.ModuleList(layers).modules():
        if isinstance(module, nn.Linear):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            nn.init.zeros_(module.bias)
    return layers


def batches(n: int, batch_size: int, epoch: int, seed: int):
    """Index tensors of this epoch's full batches; the same shuffle on every rank (the first stage's rank
    feeds the inputs, the last stage's rank the labels), the last incomplete batch dropped."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    for start in range(0, n - batch_size + 1, batch_size):
        yield order[start:start + batch_size]


def main() -> int:
    args = parse_args()
    try:
        torchpar.init_process_group(backend=args.backend)
    except torchpar.LaunchError as error:
        print(f"train_pipeline.py: {error}", file=sys.stderr)
        return 2
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    # This example logs the partition report itself, with the run's settings.
    logging.getLogger("torchpar.pipeline").setLevel(logging.WARNING)
    problem = check_args(args, world)
    if problem is None and not args.data.is_file():
        problem = f"{args.data} not found; write it with `python3 scripts/export_digits.py`"
    if problem is not None:
        if rank == 0:
            print(f"train_pipeline.py: {problem}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    data = torch.load(args.data)
    train_x, train_y = data["train_x"], data["train_y"]
    tensor_peak = torchpar.allocator.TensorPeak()  # what training holds, the data aside

    replicas = args.data_parallel
    pipeline_ranks = world // replicas
    replica = rank // pipeline_ranks
    if replicas > 1:
        pipeline_group, data_parallel_group = torchpar.pipeline.hybrid_groups(pipeline_ranks)
    else:
        pipeline_group, data_parallel_group = None, None

    torch.manual_seed(args.seed)  # every rank (and replica) starts from the same weights
    layers = mlp_layers(args.depth, args.hidden)
    share = args.batch_size // replicas  # this replica's samples of every batch
    pipe = torchpar.pipeline.Pipeline(
        layers, nn.functional.cross_entropy, microbatches=args.microbatches, schedule=args.schedule,
        virtual_stages=args.virtual_stages, balance=args.balance, sample_input=train_x[:share // args.microbatches],
        process_group=pipeline_group, data_parallel_group=data_parallel_group, checkpoint=args.checkpoint)
    stages = pipeline_ranks * args.virtual_stages
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=args.momentum)
    steps_per_epoch = len(train_x) // args.batch_size
    # Decaying the rate settles the deep MLP: with a constant one its end point varies by a few percent.
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps_per_epoch)
    logger.info("training an MLP of %d layers (%d wide) on %d digits: %d ranks = %d replica(s) x %d stages "
                "(%d per rank), schedule %s, %d micro-batches, backend %s, %d epochs, batch %d%s",
                args.depth, args.hidden, len(train_x), world, replicas, stages, args.virtual_stages,
                args.schedule, args.microbatches, dist.get_backend(), args.epochs, args.batch_size,
                ", activation checkpointing" if args.checkpoint else "")
    logger.info("partition (balance %s):\n%s", args.balance, pipe.partition_report.rstrip())

    from tqdm import tqdm

    total = args.epochs * steps_per_epoch
    checkpoints = torchpar.checkpoint.Checkpointer(args.checkpoint_dir) if args.checkpoint_dir else None
    done = 0  # steps already taken; the batches are a function of the epoch, so they are skipped
    if checkpoints is not None and (latest := checkpoints.latest_step()) is not None:
        state = checkpoints.load(latest)  # this rank's own stages
        pipe.load_state_dict(state["pipeline"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torchpar.checkpoint.set_rng_state(state["rng"])
        done = latest
        logger.info("resumed from the checkpoint of step %d of %d", done, total)

    start = time.perf_counter()
    progress = tqdm(total=total, initial=done, desc="train", unit="step", disable=rank != 0)
    for module in pipe.stage_modules.values():
        module.train()
    step, step_seconds = 0, 0.0  # the steps alone, the data handling aside
    for epoch in range(args.epochs):
        for indices in batches(len(train_x), args.batch_size, epoch, args.seed):
            step += 1
            if step <= done:
                continue
            mine = indices[replica * share:(replica + 1) * share]
            # Only the first stage reads the inputs and only the last one the labels.
            x, y = train_x[mine] if pipe.is_first_stage else None, train_y[mine] if pipe.is_last_stage else None
            step_start = time.perf_counter()
            optimizer.zero_grad()
            loss = pipe.step(x, y)
            optimizer.step()
            scheduler.step()
            step_seconds += time.perf_counter() - step_start
            if checkpoints is not None and (step % args.checkpoint_every == 0 or step == total):
                checkpoints.save(step, {"pipeline": pipe.state_dict(), "optimizer": optimizer.state_dict(),
                                        "scheduler": scheduler.state_dict(), "rng": torchpar.checkpoint.rng_state()})
            # (With --data-parallel: the loss of replica 0's share of the batch.)
            progress.set_postfix(epoch=epoch + 1, loss=f"{float(loss):.3f}", refresh=False)
            progress.update()
    progress.close()
    seconds = time.perf_counter() - start
    peak = tensor_peak.fullest_rank()

    # Every rank of each replica takes part in the forward; the last stage's rank of replica 0 scores it,
    # and the maximum over the world hands its accuracy to every rank (the others offer -1).
    for module in pipe.stage_modules.values():
        module.eval()
    outputs = pipe.forward(data["test_x"] if pipe.is_first_stage else None)
    reporter = pipe.is_last_stage and replica == 0
    accuracy = torch.tensor([-1.0], dtype=torch.float64)
    if reporter:
        accuracy.fill_((outputs.argmax(dim=1) == data["test_y"]).double().mean().item())
    dist.all_reduce(accuracy, op=dist.ReduceOp.MAX)
    accuracy = float(accuracy)
    if reporter:
        hybrid = f" x {replicas} replicas" if replicas > 1 else ""
        print(f"train_pipeline: {world} ranks, {stages} stages{hybrid}, schedule {args.schedule}, "
              f"{args.microbatches} micro-batches, {args.epochs} epochs in {seconds:.2f} s, "
              f"test accuracy {100 * accuracy:.1f}%, {1e3 * step_seconds / max(1, total - done):.2f} ms per step, peak "
              f"tensor memory {peak / 1024:.1f} KiB on the fullest rank", flush=True)
        if accuracy < TARGET_ACCURACY:
            logger.error("below the %.0f%% this example should reach", 100 * TARGET_ACCURACY)
    # Shut Gloo's worker threads down here: left running until the interpreter exits, one of them may still
    # be dropping the last collective's tensors then, and abort the process ("terminate called without an
    # active exception"). So the pipeline, which holds the process groups, goes first, and torch._dynamo
    # (imported by the first optimizer) was imported above, before init_process_group: imported later,
    # it keeps references to the default group (torch 2.15) that destroy_process_group does not drop.
    del pipe, pipeline_group, data_parallel_group
    dist.destroy_process_group()
    return 0 if accuracy >= TARGET_ACCURACY else 1


if __name__ == "__main__":
    sys.exit(main())
