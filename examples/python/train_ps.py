"""Trains a small MLP on the 8x8 digits through torchpar's parameter servers, then tests it.

    python3 scripts/export_digits.py                  # once (scripts/setup.sh does it): data/digits.pt
    torchrun --nproc-per-node=3 examples/python/train_ps.py                       # 2 workers + 1 server, BSP
    torchrun --nproc-per-node=3 examples/python/train_ps.py --consistency ssp --staleness 2
    torchrun --nproc-per-node=3 examples/python/train_ps.py --consistency asp --optimizer adam
    torchrun --nproc-per-node=4 examples/python/train_ps.py --servers 2           # 2 workers + 2 servers
    torchrun --nproc-per-node=3 examples/python/train_ps.py --checkpoint-dir /tmp/ps --checkpoint-every 50

The last --servers ranks hold the parameters (each a contiguous range of every tensor) and run the
optimizer; the other ranks are workers. Each worker trains on its own fixed shard of the training set
(reshuffled every epoch): backward pushes every gradient to the servers as soon as it is ready, and
params.step() writes the servers' new values into the model. Under BSP a server applies the mean of the
workers' gradients for a step before anyone reads it (like DDP); under SSP each gradient is applied as
it arrives and a worker may run at most --staleness steps ahead of the slowest; ASP never waits.

With --checkpoint-dir the servers restore the tables from it at start and write them every
--checkpoint-every steps and at the end; a restarted run skips the batches its checkpoint already
covers (params.clock is the step), so it continues where the checkpoint left off, and a finished run
given more --epochs trains only the new ones.

At the end the workers pull the final values, each scores its share of the held-out set, the counts are
summed, and rank 0 logs "test accuracy 97.2% ..."; the servers log their statistics. Exit code: 0, or 1
when the accuracy is below 95% (on every rank), or 2 for a wrong launch or missing data.
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
import torchpar.ps

logger = logging.getLogger("torchpar.examples.train_ps")
DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "digits.pt"
TARGET_ACCURACY = 0.95
DEFAULT_LR = {"sgd": 0.1, "adam": 0.003}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, default=DATA, help="written by scripts/export_digits.py")
    parser.add_argument("--servers", type=int, default=None,
                        help="server ranks, the last ones (default: $TORCHPAR_PS_SERVERS, else 1)")
    parser.add_argument("--consistency", choices=["bsp", "ssp", "asp"], default="bsp")
    parser.add_argument("--staleness", type=int, default=2, help="SSP: steps a worker may run ahead")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd", help="run by the servers")
    parser.add_argument("--lr", type=float, default=None, help="default: 0.1 for sgd, 0.003 for adam")
    parser.add_argument("--momentum", type=float, default=0.9, help="sgd")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=None,
                        help="servers restore from it at start and write to it")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="steps between checkpoints (0: at the end only)")
    parser.add_argument("--stats-interval", type=float, default=5.0, help="seconds between servers' stats lines")
    parser.add_argument("--backend", choices=["gloo", "shm"], default=None,
                        help="backend of the job's and the workers' process groups (default: $TORCHPAR_BACKEND, "
                             "else gloo); the service's own messages always go over Gloo")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def shard_batches(n: int, worker: int, workers: int, batch_size: int, epoch: int, seed: int):
    """This worker's full batches of an epoch: a fixed shard (every workers-th sample, the same size on
    every worker), shuffled per epoch by a generator that depends only on the seed, epoch and worker, so
    that a restarted run sees the same batches in the same order."""
    shard = torch.arange(worker, n - n % workers, workers)
    order = torch.randperm(len(shard), generator=torch.Generator().manual_seed((seed * 1000 + epoch) * 64 + worker))
    shard = shard[order]
    for start in range(0, len(shard) - batch_size + 1, batch_size):
        yield shard[start:start + batch_size]


@torch.no_grad()
def test_accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor, worker: int, workers: int,
                  group: dist.ProcessGroup) -> tuple[int, int]:
    """(correct, total) over the whole test set: each worker scores every workers-th sample, counts summed."""
    net.eval()
    mine_x, mine_y = x[worker::workers], y[worker::workers]
    counts = torch.tensor([(net(mine_x).argmax(dim=1) == mine_y).sum().item(), len(mine_y)], dtype=torch.int64)
    dist.all_reduce(counts, group=group)
    return int(counts[0]), int(counts[1])


def train(args: argparse.Namespace, service: torchpar.ps.ParameterService, data: dict,
          tensor_peak: torchpar.allocator.TensorPeak) -> float:
    """A worker's part: trains (its peak memory in `tensor_peak`), then returns the held-out accuracy (the same on
    every worker)."""
    worker, workers = service.worker_index, service.num_workers
    train_x, train_y = data["train_x"], data["train_y"]
    torch.manual_seed(args.seed)
    net = mlp()  # worker 0's initial weights start the servers' tables (or their checkpoint does)
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    if args.optimizer == "sgd":
        optimizer = torchpar.ps.SGD(lr=lr, momentum=args.momentum)
    else:
        optimizer = torchpar.ps.Adam(lr=lr)
    params = torchpar.ps.RemoteParameters(net, service.client, optimizer)
    loss_fn = nn.CrossEntropyLoss()
    steps_per_epoch = len(train_x) // workers // args.batch_size
    total = args.epochs * steps_per_epoch
    done = params.clock  # steps the servers' checkpoint already holds (0 on a fresh start)
    consistency = args.consistency + (f" (staleness {args.staleness})" if args.consistency == "ssp" else "")
    if worker == 0:
        logger.info("training an MLP 64-128-10 on %d digits: %d workers + %d server(s), %s, server-side %s, "
                    "%d epochs of %d steps, batch %d per worker", len(train_x), workers, service.num_servers,
                    consistency, optimizer, args.epochs, steps_per_epoch, args.batch_size)
        if done:
            logger.info("resuming from the servers' checkpoint at step %d of %d", done, total)

    from tqdm import tqdm

    start = time.perf_counter()
    progress = tqdm(total=total, initial=min(done, total), desc="train", unit="step", disable=worker != 0)
    net.train()
    step, step_seconds = 0, 0.0  # the steps alone, the data handling aside
    for epoch in range(args.epochs):
        for indices in shard_batches(len(train_x), worker, workers, args.batch_size, epoch, args.seed):
            step += 1
            if step <= done:
                continue  # in the checkpoint already
            x, y = train_x[indices], train_y[indices]
            step_start = time.perf_counter()
            loss = loss_fn(net(x), y)
            loss.backward()  # each parameter's gradient is pushed as soon as backward has it
            params.step()  # waits for the servers' new values and writes them into net
            step_seconds += time.perf_counter() - step_start
            progress.set_postfix(epoch=epoch + 1, loss=f"{loss.item():.3f}", refresh=False)
            progress.update()
    progress.close()
    seconds = time.perf_counter() - start
    tensor_peak.stop()

    # Once every worker is done the servers hold the final values (under SSP/ASP a worker's last reply
    # may predate the others' last pushes): pull them, then score.
    dist.barrier(group=service.worker_group)
    params.pull()
    correct, count = test_accuracy(net, data["test_x"], data["test_y"], worker, workers, service.worker_group)
    accuracy = correct / count
    if worker == 0:
        trained = max(0, total - done)
        logger.info("test accuracy %.1f%% (%d of %d held-out digits; %d steps of %d workers, %s, in %.1f s, %.2f ms "
                    "per step)", 100 * accuracy, correct, count, trained, workers, consistency, seconds,
                    1e3 * step_seconds / max(1, trained))
    params.remove()
    return accuracy


def main() -> int:
    args = parse_args()
    try:
        torchpar.init_process_group(backend=args.backend)
    except torchpar.LaunchError as error:
        print(f"train_ps.py: {error}", file=sys.stderr)
        return 2
    rank, world = dist.get_rank(), dist.get_world_size()
    if not args.data.is_file():
        if rank == 0:
            print(f"train_ps.py: {args.data} not found; write it with `python3 scripts/export_digits.py`",
                  file=sys.stderr)
        dist.destroy_process_group()
        return 2
    try:
        service = torchpar.ps.ParameterService(
            servers=args.servers, consistency=args.consistency, staleness=args.staleness,
            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
            stats_interval=args.stats_interval, worker_backend=args.backend or "")
    except RuntimeError as error:  # e.g. --servers leaving no worker
        if rank == 0:
            print(f"train_ps.py: {error}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    # Worker 0 logs the training; the servers log their tables, checkpoints and statistics lines.
    logging.basicConfig(level=logging.INFO if rank == 0 or service.is_server else logging.WARNING,
                        format="%(message)s")

    accuracy = torch.tensor([-1.0], dtype=torch.float64)  # servers offer -1 to the maximum below
    data = None if service.is_server else torch.load(args.data)
    tensor_peak = torchpar.allocator.TensorPeak()  # what a server or a worker holds, the data aside
    if service.is_server:
        summary = service.serve()  # until every worker has finished
        tensor_peak.stop()
        logger.info("server %d of %d (rank %d): %d requests, %.1f MB in, %.1f MB out, staleness at most %d, "
                    "lost workers %s; %s", service.server_index, service.num_servers, rank, summary["requests"],
                    summary["bytes_in"] / 1e6, summary["bytes_out"] / 1e6, summary["max_staleness"],
                    summary["lost_workers"] or "none",
                    ", ".join(f"{t['name']} {t['bytes']} bytes" for t in summary["tables"]))
    else:
        accuracy.fill_(train(args, service, data, tensor_peak))
        service.finish()
    # Every rank learns the result, so the exit codes agree.
    dist.all_reduce(accuracy, op=dist.ReduceOp.MAX)
    accuracy = float(accuracy)
    peak = tensor_peak.fullest_rank()
    if rank == 0:
        logger.info("peak tensor memory %.1f KiB on the fullest rank", peak / 1024)
    if accuracy < TARGET_ACCURACY and rank == 0:
        logger.error("below the %.0f%% this example should reach", 100 * TARGET_ACCURACY)
    # The service holds process groups (its own Gloo group and the workers'): close it before the default
    # group goes, and torch._dynamo was imported before init_process_group (see train_pipeline.py).
    service.close()
    del service
    dist.destroy_process_group()
    return 0 if accuracy >= TARGET_ACCURACY else 1


if __name__ == "__main__":
    sys.exit(main())
