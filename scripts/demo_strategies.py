"""The demo's second half: plan the digits models, then train them with every strategy under torchrun (C++ and
Python) and end with one table: strategy, step time and peak tensor memory per rank, each predicted and measured
with the prediction's error, and the held-out accuracy.

    python3 scripts/demo_strategies.py          # scripts/demo.sh runs it; needs the build and data/digits.pt

Each row is an example program as a user launches it (examples/). Both sides count the same things: the step time
is the mean of the program's training steps alone (forward, backward, the strategy's communication and the
optimizer step; the data handling around them aside), as the planner predicts a step; the memory is the fullest
rank's peak of CPU tensor memory while it trains, by the allocator's count (torchpar.allocator.TensorPeak; the data
loaded before aside), as the planner predicts a rank's tensors. The prediction is the planner's (python -m
torchpar.plan, without --verify's calibration) for the same model, batch, ranks and configuration, or, for a C++
program that plans itself (train_pipeline --plan), the C++ planner's for the configuration it picked and trains.
"""
from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "examples" / "cpp"
PYTHON = ROOT / "examples" / "python"
# The examples' defaults: 20 epochs, 32 samples per rank or worker (DDP, parameter server); 64 per step,
# 4 micro-batches, 1F1B (pipeline; C++ 30 epochs of a 5-layer MLP, Python 10 of an 8-layer one).
RUNS = [
    # label, language, ranks, backend (TORCHPAR_BACKEND, which the examples follow, and the planner's --backend),
    # command after torchrun's options, planned model, global batch, planned configuration
    # (DDP on shm: as a Python DDP on Gloo gets an shm group beside it, which the planner predicts.)
    ("DDP (shm)", "C++", 2, "shm", ["--no-python", BUILD / "train_ddp"], "digits_mlp", 64, "ddp, 2 replicas"),
    ("DDP (shm)", "Python", 2, "shm", [PYTHON / "train_ddp.py"], "digits_mlp", 64, "ddp, 2 replicas"),
    # The C++ pipeline plans itself (plan_on_ranks, from an empty calibration: its own engines' host time probed)
    # and trains its pick; the prediction is the one it printed.
    ("planned by C++", "C++", 2, "gloo", ["--no-python", BUILD / "train_pipeline", "--plan", "0"], None, 64,
     None),
    ("pipeline", "Python", 2, "gloo", [PYTHON / "train_pipeline.py"], "digits_deep_mlp", 64,
     "pipeline 1f1b, 2 stages, 4 micro-batches"),
    ("parameter server", "Python", 3, "gloo", [PYTHON / "train_ps.py"], "digits_mlp", 64,
     "ps bsp, 2 workers + 1 server"),
    ("pipeline x DDP", "Python", 4, "gloo", [PYTHON / "train_pipeline.py", "--data-parallel", "2"], "digits_deep_mlp",
     64, "pipeline 1f1b, 2 stages x 2 replicas, 4 micro-batches"),
    # 6 epochs of 32 samples per rank; the 64-1024x6-10 MLP, Adam, its peak under a 48 MiB cap DDP's and ZeRO-2's
    # exceed.
    ("ZeRO-3", "C++", 4, "gloo",
     ["--no-python", BUILD / "train_sharded", "--stage", "3", "--memory-per-rank", "48MiB"], "digits_wide_mlp", 128,
     "sharded zero-3, 4 replicas"),
]
STEP_MS = re.compile(r"([\d.]+) ms per step")
PEAK_KIB = re.compile(r"peak tensor memory ([\d.]+) KiB on the fullest rank")
PEAK_MIB = re.compile(r"peak allocated ([\d.]+) MiB per rank")  # train_sharded's, beside its cap
ACCURACY = re.compile(r"test accuracy ([\d.]+)%")
# What a C++ program planning itself printed: its pick (the table's first row) and the pick's tensors.
PICK = re.compile(r"^\s+1 \| (.+?)\s+\|\s+([\d.]+) \|", re.MULTILINE)
PICK_TENSORS = re.compile(r"tensors \(the allocator's peak\)\s+([\d.]+) (KiB|MiB)")


def torchrun(ranks: int, arguments: list, backend: str, calibration: pathlib.Path) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", *map(str, arguments)]
    environment = {**os.environ, "TORCHPAR_BACKEND": backend, "TORCHPAR_PLAN_CALIBRATION": str(calibration)}
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environment)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        sys.exit(f"demo: {' '.join(map(str, arguments))} failed:\n{output[-3000:]}")
    return output


@functools.cache
def planned(model: str, batch: int, ranks: int, backend: str, folder: pathlib.Path) -> dict:
    """The planner's predictions for every configuration of `model` on `ranks` ranks, by description (without
    a calibration an earlier --verify may have left)."""
    out = folder / f"{model}-{ranks}-{backend}"
    result = subprocess.run(
        [sys.executable, "-m", "torchpar.plan", "--model", f"torchpar.plan.examples:{model}", "--batch", str(batch),
         "--world", str(ranks), "--backend", backend, "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "TORCHPAR_PLAN_CALIBRATION": str(folder / "none.pt")})
    if result.returncode != 0:
        sys.exit(f"demo: planning {model} on {ranks} ranks failed:\n{(result.stdout + result.stderr)[-3000:]}")
    report = json.loads((out / "plan.json").read_text())
    return {p["configuration"]: p for p in report["ranked"]}


def self_planned(output: str) -> tuple[str, dict]:
    """The pick a C++ program planning itself printed, and its predicted step and tensors (bytes)."""
    pick = PICK.search(output)
    tensors = PICK_TENSORS.search(output)
    scale = 1024 if tensors[2] == "KiB" else 2**20
    return pick[1], {"step_ms": float(pick[2]), "tensor_memory_per_rank": float(tensors[1]) * scale}


def measured_peak(output: str) -> float:
    """The fullest rank's peak tensor memory the program printed, in bytes."""
    if (kib := PEAK_KIB.search(output)) is not None:
        return float(kib[1]) * 1024
    return float(PEAK_MIB.search(output)[1]) * 2**20


def error(predicted: float | None, measured: float) -> str:
    """Signed, against the measurement: + predicted more."""
    return f"{100 * (predicted - measured) / measured:+.0f}%" if predicted else "-"


def main() -> int:
    rows = []
    from tqdm import tqdm

    with tempfile.TemporaryDirectory() as folder:
        for label, language, ranks, backend, arguments, model, batch, configuration in tqdm(RUNS, desc="strategies",
                                                                                            unit="run"):
            calibration = pathlib.Path(folder) / "none.pt"  # every prediction a first one
            output = torchrun(ranks, arguments, backend, calibration)
            if model is None:
                configuration, prediction = self_planned(output)
                label = f"{label}: {configuration}"
            else:
                prediction = planned(model, batch, ranks, backend, pathlib.Path(folder)).get(configuration) or {}
            rows.append((label, language, ranks, prediction.get("step_ms"), float(STEP_MS.search(output)[1]),
                         prediction.get("tensor_memory_per_rank"), measured_peak(output),
                         float(ACCURACY.search(output)[1])))
    print("\n| strategy | language | ranks | step ms predicted | measured | error | tensors per rank predicted "
          "| measured | error | held-out accuracy |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, language, ranks, step_predicted, step, memory_predicted, memory, accuracy in rows:
        step_text = f"{step_predicted:.2f}" if step_predicted else "-"
        memory_text = f"{memory_predicted / 1024:.0f} KiB" if memory_predicted else "-"
        print(f"| {label} | {language} | {ranks} | {step_text} | {step:.2f} | {error(step_predicted, step)} "
              f"| {memory_text} | {memory / 1024:.0f} KiB | {error(memory_predicted, memory)} | {accuracy:.1f}% |")
    print("\nmeasured: each program's mean training step (the data handling around it aside) and its fullest rank's "
          "peak of CPU tensor memory while it trains (the data aside); predicted: python -m torchpar.plan for the "
          "same model, batch and configuration, or the C++ program's own plan (plan_on_ranks) of what it trains, "
          "without --verify's calibration.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
