"""Every test session (tests/python, tests/clients) keeps off the user's files: the planner's calibration, caches
(XDG), matplotlib's font cache — for this process and every rank or tool it starts — go to a temporary folder,
and the session fails if a test wrote under the user's ~/.cache/torchpar or ~/.cache/matplotlib anyway."""
import os
import pathlib
import shutil
import tempfile

import pytest

_SCRATCH = pathlib.Path(tempfile.mkdtemp(prefix="torchpar-tests-home-"))
os.environ["XDG_CACHE_HOME"] = str(_SCRATCH / "cache")
os.environ["MPLCONFIGDIR"] = str(_SCRATCH / "matplotlib")
os.environ["TORCHPAR_PLAN_CALIBRATION"] = str(_SCRATCH / "plan_calibration.pt")

_GUARDED = [pathlib.Path.home() / ".cache" / name for name in ("torchpar", "matplotlib")]


def _snapshot() -> dict:
    files = {}
    for folder in _GUARDED:
        for path in [folder, *folder.rglob("*")] if folder.is_dir() else []:  # a folder's time: files made and gone
            stat = path.stat()
            files[str(path)] = (stat.st_mtime_ns, stat.st_size)
    return files


def pytest_sessionstart(session):
    session.config._user_files_before = _snapshot()


def pytest_sessionfinish(session, exitstatus):
    before, after = session.config._user_files_before, _snapshot()
    touched = sorted(path for path in set(before) | set(after) if before.get(path) != after.get(path))
    shutil.rmtree(_SCRATCH, ignore_errors=True)
    if touched:
        session.config.get_terminal_writer().line(f"tests wrote the user's files: {touched}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
