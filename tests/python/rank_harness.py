"""Runs a test function on N real ranks: fresh processes joined into one process group.

    def body(rank, world):            # module level, so the ranks can import it
        t = torch.ones(2); dist.all_reduce(t); assert t.tolist() == [world, world]
        return rank

    assert run_on_ranks(3, body) == [0, 1, 2]

A failed assert, an exception, a crash, or a rank still running at the deadline fails the test with
that rank's traceback or exit status; the other ranks are killed at once, so nothing hangs.
"""
from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import pickle
import queue
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist

GRACE_AFTER_FAILURE_S = 1.0  # the others may be reporting their own failure; then they are killed
# Ranks fork from a server process that imported these once (as spawn, a clean process that never ran
# a test, started once per session), instead of each importing torch anew: ~3 s a rank on this machine.
PRELOADED_MODULES = ["torch", "torch.distributed", "torchpar"]
_child_store: dist.Store | None = None
_context: multiprocessing.context.BaseContext | None = None


def rank_context() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOADED_MODULES)
    return _context


@dataclasses.dataclass
class RankOutcome:
    rank: int
    passed: bool
    value: Any = None
    message: str = ""


class RankFailure(AssertionError):
    pass


def child_store() -> dist.Store:
    """Inside a rank: the store every rank of this run shares (a TCPStore client)."""
    assert _child_store is not None, "child_store() is only available inside run_on_ranks"
    return _child_store


def _run_rank(rank, world, port, backend, timeout_s, fn, args, results):
    global _child_store
    try:
        import torchpar

        timeout = datetime.timedelta(seconds=timeout_s)
        _child_store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        torchpar.init_process_group(backend=backend, rank=rank, world_size=world, store=_child_store, timeout=timeout)
        value = fn(rank, world, *args)
        dist.destroy_process_group()
        # Plain pickle: the queue's own pickler would pass tensors as shared-memory handles, which
        # die with this process.
        results.put((rank, True, pickle.dumps(value), ""))
    except BaseException:  # noqa: BLE001 - every failure of a rank is reported to the parent
        results.put((rank, False, None, traceback.format_exc()))


def launch_ranks(
    world: int,
    fn: Callable,
    *args,
    backend: str = "gloo",
    deadline_s: float = 120.0,
    collective_timeout_s: float = 60.0,
    grace_s: float = GRACE_AFTER_FAILURE_S,
) -> list[RankOutcome]:
    """Runs ``fn(rank, world, *args)`` on ``world`` ranks and returns every rank's outcome.

    After a rank fails, the others get ``grace_s`` to finish before they are killed (more for tests
    in which a rank dies on purpose and the others must notice)."""
    context = rank_context()
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    results = context.Queue()
    processes = [
        context.Process(
            target=_run_rank,
            args=(rank, world, store.port, backend, collective_timeout_s, fn, args, results),
            name=f"rank{rank}",
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()

    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + deadline_s
    kill_at = None
    first_failure = ""

    def record(outcome: RankOutcome) -> None:
        nonlocal kill_at, first_failure
        outcomes[outcome.rank] = outcome
        if not outcome.passed and kill_at is None:
            kill_at = time.monotonic() + grace_s
            first_failure = f"rank {outcome.rank}"

    while len(outcomes) < world:
        try:
            rank, passed, value, message = results.get(timeout=0.05)
            record(RankOutcome(rank, passed, pickle.loads(value) if passed else None, message))
        except queue.Empty:
            pass
        for rank, process in enumerate(processes):
            if rank in outcomes or process.exitcode is None:
                continue
            # It ended: its report may still be in flight through the queue.
            try:
                while True:
                    reported, passed, value, message = results.get(timeout=0.5)
                    record(RankOutcome(reported, passed, pickle.loads(value) if passed else None, message))
            except queue.Empty:
                pass
            if rank not in outcomes:
                code = process.exitcode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                record(RankOutcome(rank, False, message=f"rank {rank} {how} without reporting a result"))
        now = time.monotonic()
        if len(outcomes) < world and (now >= deadline or (kill_at is not None and now >= kill_at)):
            for rank, process in enumerate(processes):
                if rank not in outcomes:
                    process.kill()
                    why = (
                        f"was still running at the deadline of {deadline_s:g} s (hung?) and was killed"
                        if now >= deadline
                        else f"was killed after {first_failure} failed"
                    )
                    outcomes[rank] = RankOutcome(rank, False, message=f"rank {rank} {why}")
    for process in processes:
        process.join(timeout=10)
    return [outcomes[rank] for rank in range(world)]


def run_on_ranks(world: int, fn: Callable, *args, **options) -> list[Any]:
    """launch_ranks, then raises RankFailure naming every failed rank; returns each rank's value."""
    outcomes = launch_ranks(world, fn, *args, **options)
    failures = [f"--- rank {o.rank} ---\n{o.message}" for o in outcomes if not o.passed]
    if failures:
        raise RankFailure(f"{len(failures)} of {world} ranks failed:\n" + "\n".join(failures))
    return [outcome.value for outcome in outcomes]
