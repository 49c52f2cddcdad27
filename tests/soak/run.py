"""Load and soak: the parameter server with 6 workers on one server, and the shm backend with 2 groups of 4
ranks issuing collectives at once, each for a bounded time. Checks that nothing is lost (the parameter
server's table is exactly minus every push; every collective's result is exact), that resident memory stays
flat after warm-up, and that /dev/shm keeps nothing of ours; reports requests/s and collectives/s.

    python tests/soak/run.py                 # 60 s each
    python tests/soak/run.py --seconds 300
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))

from rank_harness import run_on_ranks  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
# Growth of resident memory allowed between the end of warm-up and the end: allocator noise, not a leak
# (a leak of one small tensor per request would be tens of MB here).
RSS_GROWTH_LIMIT_MB = 8.0


def resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE / 2**20


class MemorySampler:
    """This process's resident memory every half second, in a thread."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.samples.append((time.monotonic() - self._started, resident_mb()))

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def growth_after_warmup(samples: list[tuple[float, float]], seconds: float) -> float:
    """MB gained from the end of warm-up (the first quarter) to the end."""
    after = [mb for t, mb in samples if t >= seconds / 4]
    return after[-1] - after[0] if len(after) >= 2 else 0.0


def parameter_server_soak(rank, world, seconds):
    import torchpar.ps

    service = torchpar.ps.ParameterService(servers=1, consistency="asp", stats_interval=3600,
                                           timeout=datetime.timedelta(seconds=60))
    sampler = MemorySampler()
    if service.is_server:
        stats = service.serve()
        return {"role": "server", "memory": sampler.stop(), "requests": stats["requests"]}
    client = service.client
    dense = client.dense_table("dense", torch.zeros(16384), torchpar.ps.SGD(lr=1.0))
    rows = client.sparse_table("rows", 100_000, 16, torchpar.ps.SGD(lr=1.0))
    ones, row_grads = torch.ones(16384), torch.ones(64, 16)
    generator = torch.Generator().manual_seed(rank)
    pushes = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ids = torch.randint(0, 1000, (64,), generator=generator).unique()
        client.push_pull([dense], [ones]).wait()
        client.push_rows([rows], [ids], [row_grads[: len(ids)]]).wait()
        pushes += 1
    service.worker_group.barrier().wait()  # every worker's pushes are in
    final = client.pull([dense]).wait()[0]
    service.finish()
    return {"role": "worker", "memory": sampler.stop(), "pushes": pushes, "final": final[:4].tolist(),
            "constant": bool((final == final[0]).all())}


def shm_soak(rank, world, seconds):
    groups = [dist.new_group(backend="shm", timeout=datetime.timedelta(seconds=60)) for _ in range(2)]
    sampler = MemorySampler()
    counts, errors = [0, 0], []

    def issue(index: int) -> None:
        group = groups[index]
        deadline = time.monotonic() + seconds
        step = 0
        going = True
        try:
            while going:
                size = (1, 1000, 300_000)[step % 3]  # small on the caller's thread, large on the backend's
                tensor = torch.full((size,), float(rank + step % 7))
                dist.all_reduce(tensor, group=group)
                expected = sum(r + step % 7 for r in range(world))
                if not (tensor == expected).all():
                    errors.append(f"group {index}, step {step}: {tensor[:3].tolist()} != {expected}")
                # Each rank says whether its time is up; all stop after the same step.
                gathered = [torch.empty(3) for _ in range(world)]
                mine = torch.tensor([rank, step, float(time.monotonic() < deadline)])
                dist.all_gather(gathered, mine, group=group)
                if [g[:2].tolist() for g in gathered] != [[r, step] for r in range(world)]:
                    errors.append(f"group {index}, step {step}: all_gather gave {gathered}")
                going = all(g[2].item() == 1.0 for g in gathered)
                step += 1
                counts[index] += 2
        except Exception as error:  # noqa: BLE001 - reported with the rank
            errors.append(f"group {index}: {error}")

    threads = [threading.Thread(target=issue, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"memory": sampler.stop(), "collectives": counts, "errors": errors[:5]}


def our_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("torchpar-")}


def main() -> int:
    # As torchrun does: one intra-op thread per rank. With more, OpenMP's idle threads spin after every small
    # parallel op and, on a machine with fewer cores than ranks, starve the other ranks (the server's
    # sparse pushes ran 30x slower).
    os.environ["OMP_NUM_THREADS"] = "1"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="for each of the two soaks")
    args = parser.parse_args()
    problems = []
    deadline = args.seconds + 240

    print(f"parameter server: 6 workers, 1 server, ASP, {args.seconds:.0f} s", flush=True)
    results = run_on_ranks(7, parameter_server_soak, args.seconds, deadline_s=deadline, collective_timeout_s=120)
    workers, server = results[:-1], results[-1]
    pushes = sum(w["pushes"] for w in workers)
    for w in workers:
        if w["final"][0] != -pushes or not w["constant"]:
            problems.append(f"LOST/REPEATED: the table holds {w['final'][0]}, the workers pushed {pushes} times")
    growth = growth_after_warmup(server["memory"], args.seconds)
    if growth > RSS_GROWTH_LIMIT_MB:
        problems.append(f"the server's resident memory grew {growth:.1f} MB after warm-up")
    print(f"  {server['requests']} requests, {server['requests'] / args.seconds:.0f} requests/s; table = -{pushes} "
          f"exactly: {'yes' if not problems else 'NO'}; server memory {server['memory'][0][1]:.0f} MB at start, "
          f"{growth:+.1f} MB after warm-up", flush=True)

    before = our_segments()
    print(f"shm: 4 ranks, 2 groups issuing all_reduce + all_gather at once, {args.seconds:.0f} s", flush=True)
    results = run_on_ranks(4, shm_soak, args.seconds, deadline_s=deadline, collective_timeout_s=120)
    total = sum(sum(r["collectives"]) for r in results) // 4
    for rank, result in enumerate(results):
        problems += [f"shm rank {rank}: {error}" for error in result["errors"]]
        growth = growth_after_warmup(result["memory"], args.seconds)
        if growth > RSS_GROWTH_LIMIT_MB:
            problems.append(f"shm rank {rank}: resident memory grew {growth:.1f} MB after warm-up")
    leaked = our_segments() - before
    if leaked:
        problems.append(f"LEAK: /dev/shm keeps {sorted(leaked)}")
    growths = [growth_after_warmup(r["memory"], args.seconds) for r in results]
    exact = not any(result["errors"] for result in results)
    print(f"  {total} collectives per rank, {total / args.seconds:.0f}/s per rank, all exact: "
          f"{'yes' if exact else 'NO'}; memory after "
          f"warm-up {min(growths):+.1f} to {max(growths):+.1f} MB per rank; /dev/shm left: {len(leaked)}", flush=True)

    for problem in problems:
        print(f"PROBLEM: {problem}")
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
