"""A torchrun job started in the background, whose worker processes a test can find and stop: for the
restart tests and the chaos runs (tests/chaos/)."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def job_environment(**extra: str) -> dict[str, str]:
    """This checkout's package first on the path, nothing inherited from an outer torchrun."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "TORCHPAR_"))}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(variable, None)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), environment.get("PYTHONPATH")]))
    environment.update(extra)
    return environment


class LaunchedJob:
    """``torchrun <arguments>`` with its output in a temporary file."""

    def __init__(self, *arguments, **environment: str) -> None:
        self._log = tempfile.NamedTemporaryFile(mode="w+", prefix="torchpar-job-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *map(str, arguments)],
            stdout=self._log, stderr=subprocess.STDOUT, env=job_environment(**environment),
            start_new_session=True,  # the whole tree can be stopped at the end, whatever happened
        )

    @property
    def output(self) -> str:
        return pathlib.Path(self._log.name).read_text(errors="replace")

    def running(self) -> bool:
        return self.process.poll() is None

    def workers(self) -> dict[int, int]:
        """Local rank -> pid of the training processes torchrun started (its children)."""
        found = {}
        for entry in pathlib.Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent != self.process.pid:
                    continue
                environment = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            for item in environment:
                if item.startswith(b"LOCAL_RANK="):
                    found[int(item.split(b"=", 1)[1])] = int(entry.name)
        return found

    def signal_worker(self, local_rank: int, signum: int = signal.SIGKILL) -> int:
        """Sends `signum` to the worker of `local_rank`; returns its pid."""
        pid = self.workers()[local_rank]
        os.kill(pid, signum)
        return pid

    def wait(self, timeout: float) -> int:
        """The exit status; on timeout the whole job is killed and the status is None."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            return None

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def close(self) -> None:
        if self.running():
            self.stop()
        self._log.close()
        os.unlink(self._log.name)


def wait_until(condition, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()
