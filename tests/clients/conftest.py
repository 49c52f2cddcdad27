"""Real clients run torchpar through tests/python's harnesses (rank_harness, launched_job)."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
