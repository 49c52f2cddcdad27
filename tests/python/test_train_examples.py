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


PIPELINE_RESULT = re.compile(r"train_pipeline: (\d+) ranks, (\d+) stages.*test accuracy (\d+\.\d)%")


def pipeline_accuracy(output: str, ranks: int, stages: int) -> float:
    """The last stage's rank printed one result line, for this world and this many stages."""
    lines = PIPELINE_RESULT.findall(output)
    assert len(lines) == 1, output
    assert (int(lines[0][0]), int(lines[0][1])) == (ranks, stages), lines[0]
    return float(lines[0][2])


@pytest.mark.parametrize("ranks,stages", [(2, 2), (4, 4)])
def test_cpp_train_pipeline_reaches_95_percent(build_dir, digits, free_port, ranks, stages):
    binary = build_dir / "examples" / "cpp" / "train_pipeline"
    result = torchrun(f"--nproc-per-node={ranks}", f"--master-port={free_port}", "--no-python", binary,
                      "--data", digits)
    assert result.returncode == 0, result.stdout + result.stderr
    assert pipeline_accuracy(result.stdout, ranks, stages) >= 95.0


@pytest.mark.parametrize("ranks,options,stages", [
    (2, ["--schedule", "1f1b"], 2),
    (4, ["--schedule", "interleaved", "--virtual-stages", "2"], 8),  # 8 layers: one per virtual stage
    (4, ["--data-parallel", "2"], 2),  # 2 replicas x 2 stages, each replica on half of every batch
], ids=["2ranks-1f1b", "4ranks-interleaved", "4ranks-2replicas"])
def test_python_train_pipeline_reaches_95_percent(digits, free_port, ranks, options, stages):
    script = ROOT / "examples" / "python" / "train_pipeline.py"
    result = torchrun(f"--nproc-per-node={ranks}", f"--master-port={free_port}", script, "--data", digits, *options)
    assert result.returncode == 0, result.stdout + result.stderr
    assert pipeline_accuracy(result.stdout, ranks, stages) >= 95.0
