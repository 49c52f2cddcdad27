"""What every benchmark needs to start its ranks on this host."""
import datetime
import logging
import multiprocessing
import os
import queue
import socket
from typing import Callable

import torch
import torch.distributed as dist


def say_whether_pinned() -> None:
    """Ranks run where the scheduler puts them, as torchrun leaves them, unless TORCHPAR_BIND_CORES=1 pins each to
    its share of the cores (torchpar.init_process_group; the anchor's and torchpar's alike, in the same processes).
    Pinned, 2 ranks on 2 cores measured the shm all-reduce's tail shorter and DDP's overhead lower for torch and
    torchpar alike, but torchpar's pipeline slower (docs/launching.md)."""
    logging.getLogger("torchpar.bench").info(
        "ranks pinned to their share of the cores (TORCHPAR_BIND_CORES=1)"
        if os.environ.get("TORCHPAR_BIND_CORES") == "1" else "ranks placed by the scheduler (TORCHPAR_BIND_CORES=1 pins them)")


def free_port() -> int:
    """A loopback port nobody listens on now, for the ranks' rendezvous store."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_world(world: int, rank_main: Callable, options: dict) -> list[dict]:
    """Spawns `world` ranks running rank_main(rank, world, port, options, results) and returns what
    rank 0 put in `results`; if a rank fails, stops the others and says so."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(rank, world, port, options, results)) for rank in range(world)]
    for process in ranks:
        process.start()
    rows = None
    while rows is None:
        try:
            rows = results.get(timeout=1)
        except queue.Empty:
            failed = [(rank, p.exitcode) for rank, p in enumerate(ranks) if p.exitcode not in (None, 0)]
            if failed:
                for process in ranks:
                    if process.is_alive():
                        process.kill()
                raise SystemExit(f"rank {failed[0][0]} of the {world}-rank run failed (exit code {failed[0][1]})")
    for rank, process in enumerate(ranks):
        process.join()
        if process.exitcode != 0:
            raise SystemExit(f"rank {rank} of the {world}-rank run failed (exit code {process.exitcode})")
    return rows


def join_world(rank: int, world: int, port: int):
    """Inside a spawned rank: one thread, torchpar's default Gloo group, a Gloo control group for the timing's
    barriers and reductions, and the groups to compare: {"gloo": the default group, "shm": torchpar's}."""
    import torchpar  # registers "shm"

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_flush_denormal(True)
    torchpar.init_process_group(backend="gloo", timeout=datetime.timedelta(minutes=5))
    torch.set_num_threads(1)  # after init_process_group: a pinned rank's share may hold more cores
    control = dist.new_group(backend="gloo")
    return control, {"gloo": dist.group.WORLD, "shm": dist.new_group(backend="shm")}
