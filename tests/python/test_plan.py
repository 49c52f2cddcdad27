"""python -m torchpar.plan on real ranks: the strategy it recommends for models whose answer is known (checked by
the ranking's reasons, not by timings), its exclusions named with their reasons, and --verify end to end."""
import json
import subprocess
import sys

from test_torchrun import clean_env

MiB = 1 << 20


def plan(tmp_path, model, *options):
    result = subprocess.run([sys.executable, "-m", "torchpar.plan", "--model", f"torchpar.plan.examples:{model}",
                             "--out", str(tmp_path), *map(str, options)],
                            capture_output=True, text=True, timeout=300,
                            env=clean_env(TORCHPAR_PLAN_CALIBRATION=str(tmp_path / "calibration.json")))
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((tmp_path / "plan.json").read_text()), result.stdout + result.stderr


def test_a_deep_mlp_over_the_memory_cap_is_pipelined(tmp_path):
    # 8 MiB of parameters: with gradients, DDP's bucket copies and momentum, 32 MiB on every rank; 4
    # pipeline stages hold a quarter each.
    report, output = plan(tmp_path, "deep_mlp", "--batch", 64, "--world", 4, "--memory-per-rank", "12MiB")
    assert report["ranked"], output
    assert all(p["fields"]["strategy"] == "pipeline" for p in report["ranked"]), output
    assert all(p["memory_per_rank"] <= 12 * MiB for p in report["ranked"])
    reasons = {e["configuration"]: e["reason"] for e in report["excluded"]}
    assert "over the 12.0 MiB cap" in reasons["ddp, 4 replicas"], reasons
    assert any("ps bsp" in name and "over the 12.0 MiB cap" in reason for name, reason in reasons.items())
    assert "torchpar.pipeline.Pipeline(layers, loss_fn" in output and "torchpar::pipeline::Pipeline" in output
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_a_wide_embedding_over_the_memory_cap_goes_to_the_parameter_server(tmp_path):
    # ~49 MiB of embedding trained with Adam: DDP holds 5 copies of it, a pipeline stage (it cannot be cut) 4,
    # a worker 2, and each of 2 servers 3 halves.
    report, output = plan(tmp_path, "wide_embedding", "--batch", 60, "--world", 4, "--memory-per-rank", "120MiB")
    assert report["ranked"], output
    assert {p["fields"]["strategy"] for p in report["ranked"]} == {"ps"}, output
    assert all(p["fields"]["servers"] == 2 for p in report["ranked"])
    reasons = {e["configuration"]: e["reason"] for e in report["excluded"]}
    assert "over the 120.0 MiB cap" in reasons["ps bsp, 3 workers + 1 server"], reasons
    assert "torchpar.ps.ParameterService(servers=2" in output


def test_what_does_not_divide_is_excluded_by_name(tmp_path):
    report, _ = plan(tmp_path, "digits_mlp", "--batch", 10, "--world", 3)
    reasons = {e["configuration"]: e["reason"] for e in report["excluded"]}
    assert reasons["ddp, 3 replicas"] == "batch 10 does not divide into 3 ranks"
    assert "the model has 2 layers, fewer than the 3 stages" in reasons.values()


def test_verify_runs_the_top_configurations_and_reports_them(tmp_path):
    report, output = plan(tmp_path, "digits_mlp", "--batch", 64, "--world", 2, "--verify", 2,
                          "--verify-each-strategy", "--steps", 3)
    assert len(report["verified"]) >= 3, output  # the top 2 and the best of every strategy
    strategies = {row["configuration"].split()[0].rstrip(",") for row in report["verified"]}
    assert strategies == {"ddp", "pipeline", "ps"}, output
    for row in report["verified"]:
        assert row["measured_ms"] > 0 and row["predicted_ms"] > 0 and row["calibrated_ms"] > 0
    assert "predicted against measured" not in output  # the plot's title, not stdout
    assert "verified (step ms)" in output and "the top-ranked configuration measured" in output
    # What it learned is kept for the next plan on this machine, which says it uses it.
    learned = json.loads((tmp_path / "calibration.json").read_text())
    assert list(learned.values())[0] == report["learned_calibration"]
    _, again = plan(tmp_path, "digits_mlp", "--batch", 64, "--world", 2)
    assert "calibration from an earlier --verify" in again
