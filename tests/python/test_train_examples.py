"""The DDP training examples, launched as users launch them, must reach 95% held-out accuracy."""
import pathlib
import re

import pytest

from test_torchrun import ROOT, torchrun

DIGITS = ROOT / "data" / "digits.pt"


@pytest.fixture(scope="module")
def digits() -> pathlib.Path:
    assert DIGITS.exists(), f"{DIGITS} is missing: scripts/setup.sh writes it (scripts/export_digits.py)"
    return DIGITS


def accuracy_in(output: str) -> float:
    match = re.search(r"test accuracy (\d+\.\d)%", output)
    assert match, output
    return float(match[1])


def test_cpp_train_ddp_reaches_95_percent(build_dir, digits, free_port):
    binary = build_dir / "examples" / "cpp" / "train_ddp"
    result = torchrun("--nproc-per-node=2", f"--master-port={free_port}", "--no-python", binary, "--data", digits)
    assert result.returncode == 0, result.stdout + result.stderr
    assert accuracy_in(result.stdout) >= 95.0


@pytest.mark.parametrize("backend,hook", [("shm", "none"), ("gloo", "powersgd")])
def test_python_train_ddp_reaches_95_percent(digits, free_port, backend, hook):
    script = ROOT / "examples" / "python" / "train_ddp.py"
    result = torchrun("--nproc-per-node=2", f"--master-port={free_port}", script, "--data", digits,
                      "--backend", backend, "--comm-hook", hook)
    assert result.returncode == 0, result.stdout + result.stderr
    assert accuracy_in(result.stdout + result.stderr) >= 95.0
