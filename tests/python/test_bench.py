"""python -m torchpar.bench: one command runs the chosen benchmarks (here the two quickest) and writes one report
with the machine, their tables and plots, and the comparison with the previous report (a regression flagged)."""
import json
import subprocess
import sys

import pytest

from test_torchrun import ROOT, clean_env
from torchpar.bench import SECTIONS, parse_args, selected


def test_choosing_benchmarks():
    assert selected(parse_args([]).benchmarks) == list(SECTIONS)  # none named: all of them
    assert selected(parse_args(["all"]).benchmarks) == list(SECTIONS)
    assert selected(parse_args(["plan", "tp", "tp"]).benchmarks) == ["tp", "plan"]  # the report's order, once each
    with pytest.raises(SystemExit):
        parse_args(["pipelines"])


def test_bench_writes_one_report_and_flags_a_regression(tmp_path):
    # A previous report in which torchpar's tensor parallelism was 10x torch's at width 128: now it is not.
    previous = {"tp #1 row 1: 128 | torchpar/torch (gloo)": 10.0, "ddp #1 row 1: mlp | torchpar/torch": 1.0}
    (tmp_path / "report.json").write_text(json.dumps(dict(date="earlier", machine={}, quick=True, ratios=previous)))
    result = subprocess.run([sys.executable, "-m", "torchpar.bench", "tp", "plan", "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    report = (tmp_path / "report.md").read_text()
    assert "cores" in report and "torch 2." in report  # the machine
    assert "## Tensor parallelism" in report and "## Planner" in report
    assert "| width |" in report and "verified (step ms)" not in report  # tables, not logs
    assert "| configuration | predicted ms | measured ms |" in report  # the planner's --verify rows
    assert "![Tensor parallelism" in report and (tmp_path / "tensor_parallel.png").exists()
    assert "regression" in report, report  # 10x before, about 1-2x now
    assert "<table>" in (tmp_path / "report.html").read_text()
    ratios = json.loads((tmp_path / "report.json").read_text())["ratios"]
    assert ratios["tp #1 row 1: 128 | torchpar/torch (gloo)"] < 10  # this run's
    assert ratios["ddp #1 row 1: mlp | torchpar/torch"] == 1.0  # not run this time: kept for the next comparison
