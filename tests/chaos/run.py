"""Chaos runs: jobs of each strategy (DDP, pipeline, parameter server) in which one random rank is killed
(SIGKILL) or frozen (SIGSTOP) at a random moment — inside a forward or a backward, as the others enter a
collective or a checkpoint write, or at a random time from outside. Every trial must end with every
surviving rank exiting within the timeout with an error that names the dead or silent rank (never a
hang), nothing of ours left in /dev/shm, and, for the parameter server, a restart from its checkpoints
that loses and repeats no update.

    python tests/chaos/run.py                         # 20 trials per strategy, a table at the end
    python tests/chaos/run.py --strategies ps --trials 5 --seed 7
    python tests/chaos/run.py --replay ddp:1042       # one trial again, by the seed a failure printed
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))

from launched_job import job_environment, wait_until  # noqa: E402
WORKLOAD = HERE / "workload.py"
TIMEOUT_S = 4.0  # the process groups' timeout in every trial
# A survivor must report within this long after the victim stopped: a dead peer is seen at once, a
# silent one after the timeout, a parameter server's read after 1.5 timeouts; plus a process's exit.
REPORT_WITHIN_S = 2 * TIMEOUT_S + 6
HANG_AFTER_S = 4 * TIMEOUT_S + 30
PHASES = {
    "ddp": ["forward", "backward", "collective", "checkpoint", "anytime"],
    "pipeline": ["forward", "backward", "checkpoint", "anytime"],
    "ps": ["push", "pull", "anytime"],
}
STEPS = {"ddp": 12, "pipeline": 12, "ps": 60}
CHECKPOINT_EVERY = 3  # workload.py's: the steps that end with a save


@dataclasses.dataclass
class Trial:
    strategy: str
    seed: int
    world: int
    backend: str
    victim: int
    phase: str
    step: int
    signal: str
    consistency: str

    @staticmethod
    def from_seed(strategy: str, seed: int) -> "Trial":
        rng = random.Random(f"{strategy}:{seed}")
        world = rng.choice([2, 3]) if strategy != "ps" else rng.choice([3, 4])
        victim = rng.randrange(world)
        phase = rng.choice(PHASES[strategy])
        if strategy == "ps" and victim == world - 1:
            phase = "anytime"  # the server is stopped from outside
        step = rng.randrange(1, STEPS[strategy] - 2)
        if phase == "checkpoint":  # a step that ends with a save
            step = rng.randrange(CHECKPOINT_EVERY - 1, STEPS[strategy] - 1, CHECKPOINT_EVERY)
        return Trial(strategy, seed, world, rng.choice(["shm", "gloo"]), victim, phase, step,
                     rng.choice(["KILL", "KILL", "STOP"]), rng.choice(["asp", "ssp"]))

    @property
    def label(self) -> str:
        return f"{self.strategy}:{self.seed}"

    def describe(self) -> str:
        where = "from outside, at a random time" if self.phase == "anytime" else f"in {self.phase} of step {self.step}"
        extra = f", {self.consistency}" if self.strategy == "ps" else f", {self.backend}"
        return f"{self.world} ranks{extra}: SIG{self.signal} to rank {self.victim} {where}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def our_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("torchpar-")}


def process_state(pid: int) -> str:
    """'R', 'S', 'T' (stopped), 'Z' (dead, not reaped) ..., or '' when gone."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class Job:
    """The ranks of one trial, each a process of workload.py, output kept per rank."""

    def __init__(self, trial: Trial, directory: pathlib.Path, resume: bool = False) -> None:
        import torch.distributed as dist

        port = free_port()
        # The rendezvous store lives here, as torchrun's agent hosts it: a stopped rank 0 must not take
        # the store with it.
        self.store = dist.TCPStore("127.0.0.1", port, trial.world + 1, is_master=True, wait_for_workers=False)
        self.outputs = [tempfile.TemporaryFile(mode="w+") for _ in range(trial.world)]
        self.processes = []
        for rank in range(trial.world):
            environment = job_environment(
                TORCHELASTIC_USE_AGENT_STORE="True", RANK=str(rank), WORLD_SIZE=str(trial.world),
                LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(trial.world), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            victim = -1 if resume else trial.victim
            command = [sys.executable, str(WORKLOAD), "--strategy", trial.strategy, "--backend", trial.backend,
                       "--victim", str(victim), "--phase", trial.phase, "--step", str(trial.step),
                       "--signal", trial.signal, "--timeout", str(TIMEOUT_S), "--directory", str(directory),
                       "--consistency", trial.consistency] + (["--resume"] if resume else [])
            self.processes.append(subprocess.Popen(command, stdout=self.outputs[rank], stderr=subprocess.STDOUT,
                                                   env=environment, start_new_session=True))

    def output(self, rank: int) -> str:
        self.outputs[rank].seek(0)
        return self.outputs[rank].read()

    def result(self, rank: int) -> dict | None:
        lines = [line for line in self.output(rank).splitlines() if line.startswith("RESULT ")]
        return json.loads(lines[-1][len("RESULT "):]) if lines else None

    def all_ready(self) -> bool:
        return all("READY" in self.output(rank) for rank in range(len(self.processes)))

    def started_or_failed(self) -> bool:
        """Every rank ready, or one ended before it was."""
        return self.all_ready() or any(process.poll() is not None for process in self.processes)

    def describe_start(self) -> str:
        """Why the job did not get ready: each rank's state and the end of its output; a rank still running
        first writes its threads' Python stacks (workload.py registers SIGUSR1 with faulthandler)."""
        running = [process for process in self.processes if process.poll() is None]
        for process in running:
            os.kill(process.pid, signal.SIGUSR1)
        if running:
            time.sleep(1.0)
        parts = []
        for rank, process in enumerate(self.processes):
            state = "ready" if "READY" in self.output(rank) else (
                "running" if process.poll() is None else f"exited {process.returncode}")
            parts.append(f"--- rank {rank} ({state}):\n{self.output(rank)[-2500:]}")
        return "\n".join(parts)

    def kill_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait()


def names_rank(message: str, rank: int) -> bool:
    return re.search(rf"\brank(?:\(s\))?\s+(?:\d+,\s*)*{rank}\b", message) is not None


def run_trial(trial: Trial) -> dict:
    """The trial's verdict: 'ok', or what went wrong, with the details. A signal from outside that came after
    the victim had done all its work is no trial: it is repeated sooner (at most three times)."""
    latest = 0.5
    for _ in range(3):
        verdict = run_trial_once(trial, latest)
        if verdict is not None:
            return verdict
        latest /= 2
    return {"trial": trial.label, "what": trial.describe(), "restart": "",
            "problems": ["the victim finished its work before every outside signal"]}


def run_trial_once(trial: Trial, latest_signal_s: float) -> dict | None:
    segments_before = our_segments()
    with tempfile.TemporaryDirectory(prefix="torchpar-chaos-") as folder:
        directory = pathlib.Path(folder)
        job = Job(trial, directory)
        verdict = {"trial": trial.label, "what": trial.describe(), "problems": [], "restart": ""}
        try:
            started = time.monotonic()
            if not wait_until(job.started_or_failed, 120) or not job.all_ready():
                verdict["problems"].append(f"the job did not start ({time.monotonic() - started:.1f} s):\n"
                                           + job.describe_start())
                return verdict
            victim = job.processes[trial.victim]
            if trial.phase == "anytime":
                time.sleep(random.Random(trial.seed).uniform(0.0, latest_signal_s))
                if victim.poll() is None:
                    os.kill(victim.pid, getattr(signal, f"SIG{trial.signal}"))
            stopped = wait_until(lambda: victim.poll() is not None or process_state(victim.pid) == "T", HANG_AFTER_S)
            stopped_at = time.time()
            late = job.result(trial.victim)
            if trial.phase == "anytime" and late is not None and late["status"] == "finished":
                return None
            if not stopped or victim.poll() == 0:
                verdict["problems"].append("the victim was not stopped (it finished first)")
                return verdict
            survivors = [r for r in range(trial.world) if r != trial.victim]
            if not wait_until(lambda: all(job.processes[r].poll() is not None for r in survivors), HANG_AFTER_S):
                hung = [r for r in survivors if job.processes[r].poll() is None]
                verdict["problems"].append(f"HANG: rank(s) {hung} still running {HANG_AFTER_S:.0f} s after the victim stopped")
            verdict["problems"] += judge(trial, job, survivors, stopped_at)
        finally:
            job.kill_all()
        if trial.strategy == "ps" and not verdict["problems"]:
            verdict["restart"], problems = restart_ps(trial, directory)
            verdict["problems"] += problems
    leaked = our_segments() - segments_before
    if leaked:
        verdict["problems"].append(f"LEAK: /dev/shm keeps {sorted(leaked)}")
    return verdict


def judge(trial: Trial, job: Job, survivors: list[int], stopped_at: float) -> list[str]:
    problems = []
    server = trial.world - 1 if trial.strategy == "ps" else None
    for rank in survivors:
        result = job.result(rank)
        if result is None:
            problems.append(f"rank {rank} ended without a result (exit {job.processes[rank].returncode}):\n"
                            + job.output(rank)[-1500:])
            continue
        if trial.strategy == "ps" and trial.victim != server:
            # A dead or silent worker is dropped; the server and the other workers carry on to the end.
            if result["status"] != "finished":
                problems.append(f"rank {rank} failed although only a worker stopped: {result.get('message')}")
            elif rank == server and trial.victim not in result["lost_workers"]:
                problems.append(f"the server did not report worker {trial.victim} lost: {result}")
            continue
        if result["status"] != "failed":
            problems.append(f"rank {rank} finished although rank {trial.victim} stopped")
            continue
        if not names_rank(result["message"], trial.victim):
            problems.append(f"rank {rank}'s error does not name rank {trial.victim}: {result['message'][:400]}\n"
                            f"{result['traceback'][-1000:]}")
        seconds = result["failed_at"] - stopped_at
        if seconds > REPORT_WITHIN_S:
            problems.append(f"rank {rank} reported {seconds:.1f} s after the victim stopped (> {REPORT_WITHIN_S:.0f} s): "
                            f"{result['message'][:400]}")
    return problems


def restart_ps(trial: Trial, directory: pathlib.Path) -> tuple[str, list[str]]:
    """The server's checkpoint must hold exactly minus the pushes its clocks count; the job started again
    on it must end, after every worker's remaining pushes, at minus all of them."""
    import torch

    saved = torch.load(directory / "server-0-of-1.pt", weights_only=False)
    table = next(t for t in saved["tables"] if t["name"] == "w")
    pushes = [int(p) for p in table["pushes"]]
    problems = []
    if table["values"][0].item() != -sum(pushes):
        problems.append(f"LOST/REPEATED: the checkpoint holds {table['values'][0].item()}, its clocks {pushes} say "
                        f"{-sum(pushes)}")
    job = Job(trial, directory, resume=True)
    try:
        if not wait_until(lambda: all(p.poll() is not None for p in job.processes), HANG_AFTER_S + 60):
            return "", ["HANG in the restart"]
        results = [job.result(rank) for rank in range(trial.world)]
        if any(r is None or r["status"] != "finished" for r in results):
            outputs = "\n".join(f"--- rank {rank} ---\n{job.output(rank)[-2000:]}" for rank in range(trial.world))
            return "", [f"the restart failed: {[r and r.get('message') for r in results]}\n{outputs}"]
    finally:
        job.kill_all()
    workers = results[:-1]
    clocks = [r["restored_clock"] for r in workers]
    if clocks != pushes:
        problems.append(f"the workers resumed at clocks {clocks}, the checkpoint holds {pushes}")
    final = [r["final"][0] for r in workers]
    expected = -len(workers) * STEPS["ps"]
    if any(value != expected for value in final):
        problems.append(f"LOST/REPEATED: final values {final}, expected {expected}")
    return f"resumed at clocks {clocks}, ended at {final[0]:.0f}", problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", nargs="+", choices=list(PHASES), default=list(PHASES))
    parser.add_argument("--trials", type=int, default=20, help="per strategy")
    parser.add_argument("--seed", type=int, default=1, help="the first trial's seed")
    parser.add_argument("--replay", help="one trial: strategy:seed, as a failure prints it")
    args = parser.parse_args()
    if args.replay:
        strategy, seed = args.replay.split(":")
        trials = [Trial.from_seed(strategy, int(seed))]
    else:
        trials = [Trial.from_seed(s, args.seed + i) for s in args.strategies for i in range(args.trials)]

    verdicts = []
    started = time.monotonic()
    for index, trial in enumerate(trials, 1):
        began = time.monotonic()
        verdict = run_trial(trial)
        verdict["seconds"] = time.monotonic() - began
        verdicts.append(verdict)
        mark = "ok" if not verdict["problems"] else "FAILED"
        print(f"[{index}/{len(trials)}] {trial.label:14} {verdict['what']:64} {mark} ({verdict['seconds']:.1f} s)"
              + (f"; {verdict['restart']}" if verdict["restart"] else ""), flush=True)
        for problem in verdict["problems"]:
            print(f"      {problem}\n      replay: python tests/chaos/run.py --replay {trial.label}", flush=True)

    print("\n| strategy | trials | SIGKILL | SIGSTOP | survivors named the rank in time | hangs | leaks | "
          "lost updates | failed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for strategy in dict.fromkeys(t.strategy for t in trials):
        mine = [(t, v) for t, v in zip(trials, verdicts) if t.strategy == strategy]
        count = collections.Counter()
        for trial, verdict in mine:
            count["kill" if trial.signal == "KILL" else "stop"] += 1
            text = " ".join(verdict["problems"])
            count["hang"] += "HANG" in text
            count["leak"] += "LEAK" in text
            count["lost"] += "LOST" in text
            count["failed"] += bool(verdict["problems"])
        print(f"| {strategy} | {len(mine)} | {count['kill']} | {count['stop']} | {len(mine) - count['failed']} | "
              f"{count['hang']} | {count['leak']} | {count['lost']} | {count['failed']} |")
    failed = [v for v in verdicts if v["problems"]]
    # Repeated after the table: a log kept only by its tail (CI's) still says what failed and how.
    for verdict in failed:
        print(f"\nFAILED trial {verdict['trial']} ({verdict['what']}); replay: python tests/chaos/run.py "
              f"--replay {verdict['trial']}")
        for problem in verdict["problems"]:
            print("  " + problem[:8000].replace("\n", "\n  "))
    print(f"\n{len(trials)} trials in {time.monotonic() - started:.0f} s: "
          + ("all ended as they must" if not failed else f"{len(failed)} failed (each with its replay command above)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
