"""Training that survives a restart: a worker of a checkpointing job is killed mid-run under
``torchrun --max-restarts=1``; torchrun restarts every worker, they resume from the newest complete
checkpoint, and the job ends with exactly the parameters of an uninterrupted run. Also the checkpoint
folders' own rules (manifests, what is kept, a half-written step, a wrong world size)."""
import pathlib
import re
import signal
import socket
import warnings

import pytest
import torch

import torchpar
from launched_job import ROOT, LaunchedJob, wait_until
from rank_harness import run_on_ranks

DIGITS = ROOT / "data" / "digits.pt"
JOB_TIMEOUT_S = 240


def another_free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def complete_steps(directory: pathlib.Path) -> list[int]:
    return sorted(int(folder.name[len("step-"):]) for folder in directory.glob("step-*") if (folder / "MANIFEST").exists())


def run_job(command: list, directory: pathlib.Path, free_port: int, kill_after_step: int | None) -> tuple[str, int]:
    """Runs the job to its end; with `kill_after_step`, SIGKILLs local rank 1 once a complete checkpoint of at
    least that step exists. Returns the output and the steps complete when the worker was killed."""
    job = LaunchedJob("--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.2",
                      f"--master-port={free_port}", *command, "--checkpoint-dir", directory)
    try:
        newest_at_kill = None
        if kill_after_step is not None:
            reached = wait_until(lambda: any(s >= kill_after_step for s in complete_steps(directory)) or not job.running(),
                                 timeout=JOB_TIMEOUT_S)
            assert reached and job.running(), f"the job ended before step {kill_after_step}:\n{job.output}"
            job.signal_worker(1, signal.SIGKILL)
            newest_at_kill = max(complete_steps(directory))
        status = job.wait(JOB_TIMEOUT_S)
        output = job.output
        assert status == 0, f"exit status {status}:\n{output}"
        return output, newest_at_kill
    finally:
        job.close()


def final_states(directory: pathlib.Path, load) -> list[dict]:
    last = directory / f"step-{max(complete_steps(directory)):012d}"
    return [load(last / f"rank-{rank}-of-2.pt") for rank in range(2)]


def python_state(path: pathlib.Path) -> dict:
    state = torch.load(path, weights_only=False)
    return state.get("model") or state["pipeline"]["modules"]


def cpp_state(path: pathlib.Path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load reads LibTorch's archives
        return {k: v for k, v in torch.jit.load(str(path)).state_dict().items() if not k.startswith("optimizer")}


CASES = {
    "python ddp": ([ROOT / "examples/python/train_ddp.py", "--epochs", "12", "--checkpoint-every", "20"], python_state),
    "python pipeline": ([ROOT / "examples/python/train_pipeline.py", "--epochs", "8", "--checkpoint-every", "20"],
                        python_state),
    "c++ ddp": (["--no-python", "{build}/examples/cpp/train_ddp", "--epochs", "12", "--checkpoint-every", "20"],
                cpp_state),
}
RESUMED = re.compile(r"resumed from the checkpoint of step (\d+)")


@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_worker_is_restarted_and_the_job_ends_as_if_uninterrupted(case, tmp_path, free_port, build_dir):
    assert DIGITS.exists(), "scripts/setup.sh writes data/digits.pt"
    arguments, load = CASES[case]
    command = [str(a).format(build=build_dir) for a in arguments] + ["--data", DIGITS]
    interrupted, uninterrupted = tmp_path / "interrupted", tmp_path / "uninterrupted"

    output, newest_at_kill = run_job(command, interrupted, free_port, kill_after_step=100)
    resumed = [int(step) for step in RESUMED.findall(output)]
    assert len(resumed) == 1, f"expected one resume, found {resumed}:\n{output}"
    # The newest complete checkpoint when the worker died (one more may have completed in between).
    assert resumed[0] >= newest_at_kill and resumed[0] % 20 == 0, (resumed, newest_at_kill)

    run_job(command, uninterrupted, another_free_port(), kill_after_step=None)
    assert complete_steps(interrupted)[-1] == complete_steps(uninterrupted)[-1]
    for mine, reference in zip(final_states(interrupted, load), final_states(uninterrupted, load)):
        assert mine.keys() == reference.keys()
        for name in mine:
            assert torch.equal(mine[name], reference[name]), f"{name} differs after the restart"


def checkpoint_rules(rank, world, directory):
    import torch.distributed as dist

    directory = pathlib.Path(directory)
    checkpoints = torchpar.checkpoint.Checkpointer(directory, keep=2)
    assert checkpoints.latest_step() is None
    for step in (10, 20, 30):
        checkpoints.save(step, {"rank": rank, "step": step, "weights": torch.full((3,), float(step))})
    assert checkpoints.latest_step() == 30
    state = checkpoints.load(30)
    assert state["rank"] == rank and state["step"] == 30 and torch.equal(state["weights"], torch.full((3,), 30.0))
    assert complete_steps(directory) == [20, 30]  # keep=2: step 10 removed
    assert not list(directory.rglob("*.tmp-*"))  # nothing half-written left
    dist.barrier()
    # A step whose manifest never came (rank 0 died mid-save) does not count; a later save removes it.
    if rank == 0:
        (directory / "step-000000000040").mkdir()
        (directory / "step-000000000040" / "rank-0-of-2.pt").write_bytes(b"half")
    dist.barrier()
    assert checkpoints.latest_step() == 30
    with pytest.raises(RuntimeError, match="no complete checkpoint at step 40"):
        checkpoints.load(40)
    checkpoints.save(50, {"rank": rank})
    assert complete_steps(directory) == [30, 50] and not (directory / "step-000000000040").exists()
    # A rank that cannot write makes the save fail on every rank, naming it; the older steps stay.
    unwritable = directory / "step-000000000060"
    if rank == 1:
        unwritable.mkdir()
        (unwritable / "rank-1-of-2.pt").mkdir()  # a folder where the file should go
    dist.barrier()
    with pytest.raises(RuntimeError, match=r"checkpoint step 60 in .*: rank\(s\) 1 could not write their state"):
        checkpoints.save(60, {"rank": rank})
    assert checkpoints.latest_step() == 50
    return True


def test_checkpoint_folders_count_only_complete_steps_and_keep_the_newest(tmp_path):
    assert run_on_ranks(2, checkpoint_rules, str(tmp_path)) == [True, True]


def another_world(rank, world, directory):
    checkpoints = torchpar.checkpoint.Checkpointer(directory)
    checkpoints.save(5, {"rank": rank})
    return True


def load_with_three(rank, world, directory):
    checkpoints = torchpar.checkpoint.Checkpointer(directory)
    with pytest.raises(RuntimeError, match="step 5 .* was written by 2 ranks, this job has 3; resume it with the same"):
        checkpoints.load(checkpoints.latest_step())
    return True


def test_resuming_with_another_number_of_ranks_is_refused(tmp_path):
    run_on_ranks(2, another_world, str(tmp_path))
    assert run_on_ranks(3, load_with_three, str(tmp_path)) == [True] * 3
