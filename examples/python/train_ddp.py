"""Trains a small MLP on the 8x8 digits with torchpar's DistributedDataParallel, then tests it.

    python3 scripts/export_digits.py                  # once (scripts/setup.sh does it): data/digits.pt
    torchrun --nproc-per-node=2 examples/python/train_ddp.py
    torchrun --nproc-per-node=2 examples/python/train_ddp.py --backend shm --comm-hook fp16
    torchrun --nproc-per-node=2 examples/python/train_ddp.py --epochs 30 --lr 0.05 --comm-hook powersgd
    torchrun --nproc-per-node=2 --max-restarts=3 examples/python/train_ddp.py --checkpoint-dir ckpt

Every rank trains on its own shard of the training set (DistributedSampler); DDP averages the
gradients, so the ranks keep identical weights. At the end each rank scores its share of the held-out
set, the counts are summed, and rank 0 logs "test accuracy 97.2% ..." with the mean step time (the steps
alone, the data handling aside) and the fullest rank's peak tensor memory (torchpar.allocator.TensorPeak). Exit
code: 0, or 1 when the accuracy is below 95%, or 2 for a wrong launch or missing data.

With --checkpoint-dir the run saves model, optimizer, position and RNG state every --checkpoint-every
steps and at the end; started again (by torchrun after a failure, or by hand) it resumes from the newest
complete checkpoint and ends exactly as an uninterrupted run would.
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchpar

logger = logging.getLogger("torchpar.examples.train_ddp")
DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "digits.pt"
TARGET_ACCURACY = 0.95


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, default=DATA, help="written by scripts/export_digits.py")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--backend", choices=["gloo", "shm"], default=None,
                        help="process-group backend (default: $TORCHPAR_BACKEND, else gloo)")
    parser.add_argument("--comm-hook", choices=["none", "fp16", "bf16", "powersgd"], default="none",
                        help="compress gradients before the all-reduce")
    parser.add_argument("--powersgd-rank", type=int, default=2, help="matrix_approximation_rank of PowerSGD")
    parser.add_argument("--powersgd-start", type=int, default=10,
                        help="start_powerSGD_iter: plain all-reduce before this step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=None,
                        help="save checkpoints here and resume from the newest one (a folder every rank sees)")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    return parser.parse_args()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def register_comm_hook(model: nn.Module, args: argparse.Namespace) -> None:
    from torchpar import ddp

    if args.comm_hook == "fp16":
        model.register_comm_hook(None, ddp.fp16_compress_hook)
    elif args.comm_hook == "bf16":
        model.register_comm_hook(None, ddp.bf16_compress_hook)
    elif args.comm_hook == "powersgd":
        state = ddp.PowerSGDState(matrix_approximation_rank=args.powersgd_rank,
                                  start_powerSGD_iter=args.powersgd_start)
        model.register_comm_hook(state, ddp.powerSGD_hook)


@torch.no_grad()
def test_accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> tuple[int, int]:
    """(correct, total) over the whole test set: each rank scores every world-th sample, counts are summed."""
    net.eval()
    mine_x, mine_y = x[rank::world], y[rank::world]
    counts = torch.tensor([(net(mine_x).argmax(dim=1) == mine_y).sum().item(), len(mine_y)], dtype=torch.int64)
    dist.all_reduce(counts)
    return int(counts[0]), int(counts[1])


def continue_random_streams(saved_state, at_checkpointed_position: bool):
    """Restores the checkpoint's generator state at the loop position where it was saved, so every
    random draw after a restart (dropout, a new epoch's loader seed) is the one an uninterrupted run
    makes; returns what is left to restore."""
    if saved_state is not None and at_checkpointed_position:
        torchpar.checkpoint.set_rng_state(saved_state)
        return None
    return saved_state


def main() -> int:
    args = parse_args()
    try:
        torchpar.init_process_group(backend=args.backend)
    except torchpar.LaunchError as error:
        print(f"train_ddp.py: {error}", file=sys.stderr)
        return 2
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    if not args.data.is_file():
        print(f"train_ddp.py: {args.data} not found; write it with `python3 scripts/export_digits.py`", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    data = torch.load(args.data)
    train = TensorDataset(data["train_x"], data["train_y"])
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    tensor_peak = torchpar.allocator.TensorPeak()  # what training holds, the data aside

    torch.manual_seed(args.seed)
    net = mlp()
    model = torchpar.DistributedDataParallel(net)  # broadcasts rank 0's weights to every rank
    register_comm_hook(model, args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = nn.CrossEntropyLoss()
    logger.info("training an MLP 64-128-10 on %d digits: %d ranks, backend %s, comm hook %s, %d epochs, "
                "batch %d per rank", len(train), world, dist.get_backend(), args.comm_hook, args.epochs,
                args.batch_size)

    from tqdm import tqdm

    total = args.epochs * len(loader)
    checkpoints = torchpar.checkpoint.Checkpointer(args.checkpoint_dir) if args.checkpoint_dir else None
    done, resume_rng = 0, None  # steps already taken, and the RNG state to continue from
    if checkpoints is not None and (latest := checkpoints.latest_step()) is not None:
        state = checkpoints.load(latest)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        done, resume_rng = latest, state["rng"]
        logger.info("resumed from the checkpoint of step %d of %d", done, total)

    start = time.perf_counter()
    progress = tqdm(total=total, initial=done, desc="train", unit="step", disable=rank != 0)
    step, step_seconds = 0, 0.0  # the steps alone, the data handling aside
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
        if step + len(loader) <= done:  # an epoch finished before the restart
            step += len(loader)
            continue
        model.train()
        resume_rng = continue_random_streams(resume_rng, step == done)
        for x, y in loader:  # (a new iterator draws a seed from torch's generator)
            if step < done:  # the data order is a function of the epoch: skip what was trained on
                step += 1
                continue
            resume_rng = continue_random_streams(resume_rng, True)
            step_start = time.perf_counter()
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()  # DDP all-reduces the gradients, bucket by bucket, during backward
            optimizer.step()
            step_seconds += time.perf_counter() - step_start
            step += 1
            if checkpoints is not None and (step % args.checkpoint_every == 0 or step == total):
                checkpoints.save(step, {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                                        "epoch": epoch, "rng": torchpar.checkpoint.rng_state()})
            progress.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}", refresh=False)
            progress.update()
    progress.close()
    seconds = time.perf_counter() - start
    step_ms = 1e3 * step_seconds / max(1, total - done)
    peak = tensor_peak.fullest_rank()

    correct, total = test_accuracy(net, data["test_x"], data["test_y"], rank, world)
    accuracy = correct / total
    logger.info("test accuracy %.1f%% (%d of %d held-out digits; %d epochs on %d ranks in %.2f s, %.2f ms per step, "
                "peak tensor memory %.1f KiB on the fullest rank)", 100 * accuracy, correct, total, args.epochs, world,
                seconds, step_ms, peak / 1024)
    if accuracy < TARGET_ACCURACY and rank == 0:
        logger.error("below the %.0f%% this example should reach", 100 * TARGET_ACCURACY)
    dist.destroy_process_group()
    return 0 if accuracy >= TARGET_ACCURACY else 1


if __name__ == "__main__":
    sys.exit(main())
