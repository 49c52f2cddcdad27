"""The demo's second half: plan the digits models, then train them with every strategy under torchrun (C++ and
Python) and end with one table: strategy, samples/s measured and predicted, held-out accuracy, memory per rank.

    python3 scripts/demo_strategies.py          # scripts/demo.sh runs it; needs the build and data/digits.pt

Each row is an example program as a user launches it (examples/); its training time is what the program
prints, so samples/s includes its data handling. The prediction is the planner's (python -m torchpar.plan)
for the same model, batch, ranks and configuration.
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

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "digits.pt"
BUILD = ROOT / "build" / "examples" / "cpp"
PYTHON = ROOT / "examples" / "python"
# The examples' defaults: 20 epochs, 32 samples per rank or worker (DDP, parameter server); 64 per step,
# 4 micro-batches, 1F1B (pipeline; C++ 30 epochs, Python 10).
RUNS = [
    # label, language, ranks, command after torchrun's options, planned model, global batch, planned configuration
    ("DDP", "C++", 2, ["--no-python", BUILD / "train_ddp"], "digits_mlp", 64, "ddp, 2 replicas"),
    ("DDP (shm)", "Python", 2, [PYTHON / "train_ddp.py", "--backend", "shm"], "digits_mlp", 64, "ddp, 2 replicas"),
    ("pipeline", "C++", 2, ["--no-python", BUILD / "train_pipeline"], "digits_deep_mlp", 64,
     "pipeline 1f1b, 2 stages, 4 micro-batches"),
    ("pipeline", "Python", 2, [PYTHON / "train_pipeline.py"], "digits_deep_mlp", 64,
     "pipeline 1f1b, 2 stages, 4 micro-batches"),
    ("parameter server", "Python", 3, [PYTHON / "train_ps.py"], "digits_mlp", 64, "ps bsp, 2 workers + 1 server"),
    ("pipeline x DDP", "Python", 4, [PYTHON / "train_pipeline.py", "--data-parallel", "2"], "digits_deep_mlp", 64,
     "pipeline 1f1b, 2 stages x 2 replicas, 4 micro-batches"),
    # 6 epochs of 32 samples per rank; the 64-1024x6-10 MLP, Adam, its peak under a 48 MiB cap DDP's and ZeRO-2's
    # exceed.
    ("ZeRO-3", "C++", 4, ["--no-python", BUILD / "train_sharded", "--stage", "3", "--memory-per-rank", "48MiB"],
     "digits_wide_mlp", 128, "sharded zero-3, 4 replicas"),
]
EPOCHS = re.compile(r"(\d+) epochs(?: on \d+ ranks)? in ([\d.]+) s")
PS_STEPS = re.compile(r"(\d+) steps of (\d+) workers, \w+, in ([\d.]+) s")
ACCURACY = re.compile(r"test accuracy ([\d.]+)%")


def torchrun(ranks: int, arguments: list) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", *map(str, arguments)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        sys.exit(f"demo: {' '.join(map(str, arguments))} failed:\n{output[-3000:]}")
    return output


@functools.cache
def planned(model: str, batch: int, ranks: int, backend: str, folder: pathlib.Path) -> dict:
    """The planner's predictions for every configuration of `model` on `ranks` ranks, by description (without
    a calibration an earlier --verify may have left)."""
    out = folder / f"{model}-{ranks}-{backend}"
    subprocess.run([sys.executable, "-m", "torchpar.plan", "--model", f"torchpar.plan.examples:{model}", "--batch",
                    str(batch), "--world", str(ranks), "--backend", backend, "--out", str(out)], check=True,
                   capture_output=True, cwd=ROOT,
                   env={**os.environ, "TORCHPAR_PLAN_CALIBRATION": str(folder / "none.json")})
    report = json.loads((out / "plan.json").read_text())
    return {p["configuration"]: p for p in report["ranked"]}


def main() -> int:
    train_samples = len(torch.load(DATA)["train_x"])
    rows = []
    from tqdm import tqdm

    with tempfile.TemporaryDirectory() as folder:
        for label, language, ranks, arguments, model, batch, configuration in tqdm(RUNS, desc="strategies",
                                                                                   unit="run"):
            backend = "shm" if "shm" in arguments else "gloo"
            prediction = planned(model, batch, ranks, backend, pathlib.Path(folder)).get(configuration)
            output = torchrun(ranks, arguments)
            if (steps := PS_STEPS.search(output)) is not None:
                samples, seconds = int(steps[1]) * int(steps[2]) * 32, float(steps[3])
            else:
                epochs = EPOCHS.search(output)
                samples, seconds = int(epochs[1]) * train_samples // batch * batch, float(epochs[2])
            rows.append((label, language, ranks, samples / seconds,
                         prediction["samples_per_second"] if prediction else None,
                         float(ACCURACY.search(output)[1]), prediction["memory_per_rank"] if prediction else None))
    print("\n| strategy | language | ranks | samples/s | predicted | held-out accuracy | memory per rank (predicted) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for label, language, ranks, measured, predicted, accuracy, memory in rows:
        predicted_text = f"{predicted:.0f}" if predicted else "-"
        memory_text = f"{memory / 1024:.0f} KiB" if memory else "-"
        print(f"| {label} | {language} | {ranks} | {measured:.0f} | {predicted_text} | {accuracy:.1f}% "
              f"| {memory_text} |")
    print("\nsamples/s measured from each program's own training time (its data handling included); predicted: "
          "python -m torchpar.plan for the same model, batch and configuration, without --verify's calibration.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
