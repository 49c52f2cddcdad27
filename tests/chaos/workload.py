"""One rank of a chaos trial (tests/chaos/run.py starts every rank of a job with this script).

The trial's victim rank stops itself with the trial's signal at a chosen moment of its training — inside
a forward, inside a backward, after its forward while the others wait in the gradient all-reduce, as the
others enter a checkpoint write — or, with ``--phase anytime``, the harness signals it from outside after
a random delay. Every rank prints one line at its end: ``RESULT {json}`` with ``status`` ("finished" or "failed"),
the error message and the seconds from the first failure to the exit.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import pathlib
import signal
import sys
import time
import traceback

# Before torch's import, which takes seconds: the harness asks a rank that did not get ready for its threads'
# stacks (SIGUSR1).
faulthandler.register(signal.SIGUSR1, all_threads=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import torchpar  # noqa: E402
import torchpar.pipeline  # noqa: E402
import torchpar.ps  # noqa: E402

STEPS = 12
PS_STEPS = 60
CHECKPOINT_EVERY = 3
# A training step's compute: the job outlasts the harness's latest outside signal (0.5 s after READY).
STEP_SECONDS = 0.05


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=["ddp", "pipeline", "ps"], required=True)
    parser.add_argument("--backend", choices=["gloo", "shm"], default="shm")
    parser.add_argument("--victim", type=int, required=True)
    parser.add_argument("--phase", required=True)
    parser.add_argument("--step", type=int, required=True, help="the victim's step at which it stops")
    parser.add_argument("--signal", choices=["KILL", "STOP"], required=True)
    parser.add_argument("--timeout", type=float, required=True, help="the process groups' timeout, seconds")
    parser.add_argument("--directory", type=pathlib.Path, required=True, help="checkpoints")
    parser.add_argument("--consistency", default="asp", help="ps only")
    parser.add_argument("--resume", action="store_true", help="ps only: the restart after the trial")
    return parser.parse_args()


class Victim:
    """Stops this process at (step, phase) when it is the trial's victim."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.armed = rank == args.victim and args.phase != "anytime"
        self.phase, self.step, self.signum = args.phase, args.step, getattr(signal, f"SIG{args.signal}")
        self.current_step = 0

    def at(self, phase: str) -> None:
        if self.armed and phase == self.phase and self.current_step == self.step:
            sys.stdout.flush()
            os.kill(os.getpid(), self.signum)


def ready() -> None:
    """Set up: from here on the harness may stop the victim from outside."""
    print("READY", flush=True)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def batch(step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(size, 32, generator=generator), torch.randn(size, 4, generator=generator)


def train_ddp(args: argparse.Namespace, victim: Victim, rank: int) -> None:
    model = mlp()
    model[2].register_forward_pre_hook(lambda *_: victim.at("forward"))
    ddp = torchpar.DistributedDataParallel(model, bucket_cap_mb=0.01)
    model[2].weight.register_hook(lambda grad: victim.at("backward"))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    checkpoints = torchpar.checkpoint.Checkpointer(args.directory)
    ready()
    for step in range(STEPS):
        victim.current_step = step
        time.sleep(STEP_SECONDS)
        x, y = batch(step * dist.get_world_size() + rank)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        victim.at("collective")  # the others finish their backward and wait in the bucket all-reduces
        loss.backward()
        optimizer.step()
        if step % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1:
            victim.at("checkpoint")
            checkpoints.save(step + 1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})


def train_pipeline(args: argparse.Namespace, victim: Victim, rank: int) -> None:
    layers = list(mlp())
    for layer in layers:  # whichever stage the victim holds
        layer.register_forward_pre_hook(lambda *_: victim.at("forward"))
        if isinstance(layer, nn.Linear):
            layer.weight.register_hook(lambda grad: victim.at("backward"))
    pipe = torchpar.pipeline.Pipeline(layers, nn.functional.mse_loss, microbatches=4, schedule="1f1b",
                                      balance=[2, 3] if dist.get_world_size() == 2 else [1, 2, 2])
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    checkpoints = torchpar.checkpoint.Checkpointer(args.directory)
    ready()
    for step in range(STEPS):
        victim.current_step = step
        time.sleep(STEP_SECONDS)
        x, y = batch(step)
        optimizer.zero_grad()
        pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None)
        optimizer.step()
        if step % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1:
            victim.at("checkpoint")
            checkpoints.save(step + 1, {"pipeline": pipe.state_dict(), "optimizer": optimizer.state_dict()})


def train_ps(args: argparse.Namespace, victim: Victim, rank: int) -> dict:
    """Every worker pushes a gradient of ones to a table of zeros with SGD(lr=1), so the table always holds
    minus the number of pushes applied: a restart that lost or repeated an update shows."""
    service = torchpar.ps.ParameterService(servers=1, consistency=args.consistency, staleness=1,
                                           checkpoint_dir=str(args.directory), checkpoint_every=2,
                                           timeout=args.timeout, stats_interval=3600)
    if service.is_server:  # a server victim is stopped from outside (phase "anytime")
        ready()
        stats = service.serve()
        return {"lost_workers": stats["lost_workers"]}
    client = service.client
    table = client.dense_table("w", torch.zeros(8), torchpar.ps.SGD(lr=1.0))
    ready()
    restored_clock = client.clock(table)
    for step in range(restored_clock, PS_STEPS):
        victim.current_step = step
        victim.at("push")
        client.push([table], [torch.ones(8)]).wait()
        victim.at("pull")
        client.pull([table]).wait()
        time.sleep(STEP_SECONDS / 5)
    if args.resume:  # every worker's pushes are in before the final read
        service.worker_group.barrier().wait()
    final = client.pull([table]).wait()[0]
    service.finish()
    return {"restored_clock": restored_clock, "final": final.tolist()}


def wait_for_every_rank() -> None:
    """Meets the other ranks on the harness's store, with time to spare, before the process group is made:
    its rendezvous has the trial's short timeout, which ranks still importing torch on a loaded machine (seconds
    apart) could outlast. The trial is about faults once the job runs."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=100))
    if store.add("chaos/arrived", 1) == int(os.environ["WORLD_SIZE"]):
        store.set("chaos/everyone", "1")
    store.wait(["chaos/everyone"])


def main() -> int:
    args = parse_args()
    wait_for_every_rank()
    torchpar.init_process_group(backend=args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    victim = Victim(args, rank)
    result: dict = {"rank": rank}
    try:
        if args.strategy == "ddp":
            train_ddp(args, victim, rank)
        elif args.strategy == "pipeline":
            train_pipeline(args, victim, rank)
        else:
            result.update(train_ps(args, victim, rank) or {})
        result["status"] = "finished"
    except Exception as error:  # noqa: BLE001 - the harness judges every failure
        result.update(status="failed", message=f"{type(error).__name__}: {error}", failed_at=time.time(),
                      traceback=traceback.format_exc()[-3000:])
    print("RESULT " + json.dumps(result), flush=True)
    # After a failure the groups may be unusable: leave without the collective teardown.
    os._exit(0 if result["status"] == "finished" else 1)


if __name__ == "__main__":
    sys.exit(main())
