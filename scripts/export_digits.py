"""Writes data/digits.pt: scikit-learn's bundled 8x8 digits, split once into train and test.

    python3 scripts/export_digits.py [--out data/digits.pt]

The data ships inside scikit-learn (`sklearn.datasets.load_digits`), so nothing is downloaded. The
file is a dict of four contiguous tensors saved with `torch.save` (zip format), which Python reads
with `torch.load` and C++ with `torch::jit::pickle_load`:

    train_x  float32 [N_train, 64]  pixel values 0..16 scaled to [0, 1]
    train_y  int64   [N_train]      class 0..9
    test_x   float32 [N_test, 64]
    test_y   int64   [N_test]

The split is fixed: 80% train / 20% test after a permutation from numpy's legacy RandomState(0),
whose stream numpy keeps stable across releases, so every machine writes the same split.
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import pathlib

import numpy as np
import torch

logger = logging.getLogger("torchpar.data")
REPO = pathlib.Path(__file__).resolve().parent.parent
TRAIN_FRACTION = 0.8
SEED = 0


def digits_split() -> dict[str, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.from_numpy(digits.data.astype(np.float32) / 16.0)
    y = torch.from_numpy(digits.target.astype(np.int64))
    order = torch.from_numpy(np.random.RandomState(SEED).permutation(len(y)))
    n_train = int(round(TRAIN_FRACTION * len(y)))
    train, test = order[:n_train], order[n_train:]
    # Indexing copies, so each tensor owns exactly its own storage (nothing extra gets saved).
    return {"train_x": x[train].contiguous(), "train_y": y[train].contiguous(),
            "test_x": x[test].contiguous(), "test_y": y[test].contiguous()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "data" / "digits.pt")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    split = digits_split()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(args.out.name + ".partial")
    buffer = io.BytesIO()
    torch.save(split, buffer)  # into memory first, so the archive's inner name is not the temporary file's
    partial.write_bytes(buffer.getvalue())
    os.replace(partial, args.out)  # never leaves a half-written file under the final name
    logger.info("wrote %s: %d train and %d test digits, 64 features in [0, 1], 10 classes",
                args.out, len(split["train_y"]), len(split["test_y"]))


if __name__ == "__main__":
    main()
