"""python -m torchpar.plan on real ranks: the strategy it recommends for models whose answer is known (checked by
the ranking's reasons, not by timings), its exclusions named with their reasons, and --verify end to end."""
import json
import subprocess
import sys

from test_torchrun import clean_env

MiB = 1 << 20


def plan(tmp_path, model, *options, **environment):
    result = subprocess.run([sys.executable, "-m", "torchpar.plan", "--model", f"torchpar.plan.examples:{model}",
                             "--out", str(tmp_path), *map(str, options)],
                            capture_output=True, text=True, timeout=300,
                            env=clean_env(TORCHPAR_PLAN_CALIBRATION=str(tmp_path / "calibration.pt"),
                                          **environment))
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((tmp_path / "plan.json").read_text()), result.stdout + result.stderr


def test_a_deep_mlp_over_the_memory_cap_is_pipelined(tmp_path):
    # 8 MiB of parameters: with gradients, DDP's bucket copies and momentum, 32 MiB on every rank and the shm
    # segment's pages; 4 pipeline stages hold a quarter each and the pages of their rings (4 MiB each, 2 per
    # neighbour), a tensor group of 4 and 2 stages of 2-rank tensor groups a quarter; ZeRO-3 a quarter of the
    # parameters, their gradients and momentum and one layer gathered (and the whole model while it wraps it);
    # ZeRO-1 and 2 keep the whole parameters: over the cap.
    report, output = plan(tmp_path, "deep_mlp", "--batch", 64, "--world", 4, "--memory-per-rank", "25MiB",
                          "--verify", 1, "--verify-each-strategy", "--steps", 2, "--explain-memory")
    assert report["ranked"], output
    # Pipelines, tensor parallelism and ZeRO-3 split the parameters; the pipeline, with no collective per layer,
    # first.
    assert {p["fields"]["strategy"] for p in report["ranked"]} == {"pipeline", "tensor", "sharded"}, output
    assert {p["fields"]["zero_stage"] for p in report["ranked"] if p["fields"]["strategy"] == "sharded"} == {3}
    assert report["ranked"][0]["fields"]["strategy"] == "pipeline", output
    assert all(p["memory_per_rank"] <= 25 * MiB for p in report["ranked"])
    reasons = {e["configuration"]: e["reason"] for e in report["excluded"]}
    assert "over the 25.0 MiB cap" in reasons["ddp, 4 replicas"], reasons
    assert "over the 25.0 MiB cap" in reasons["sharded zero-2, 4 replicas"], reasons
    assert any("ps bsp" in name and "over the 25.0 MiB cap" in reason for name, reason in reasons.items())
    assert "torchpar.pipeline.Pipeline(layers, loss_fn" in output and "torchpar::pipeline::Pipeline" in output
    assert (tmp_path / "plan.png").stat().st_size > 0
    # 3-D: the best pipeline of tensor groups was run too (its stages' Linear layers split over 2 ranks).
    three_d = [row for row in report["verified"] if "stages x 2 tensor" in row["configuration"]]
    assert len(three_d) == 1 and three_d[0]["measured_ms"] > 0, output
    assert len({row["configuration"].split(",")[0] for row in report["verified"]}) >= 2, output
    # ZeRO-3 was run too, each layer a unit.
    zero3 = [row for row in report["verified"] if row["configuration"] == "sharded zero-3, 4 replicas"]
    assert len(zero3) == 1 and zero3[0]["measured_ms"] > 0, output
    # The tensors each verified configuration's fullest rank held at its peak (the allocator's count) are the
    # memory model's within 10%.
    for row in report["verified"]:
        assert row["measured_allocated"] > 0, row
        assert abs(row["predicted_tensor_memory"] - row["measured_allocated"]) <= 0.10 * row["measured_allocated"], (
            row, output)
    # --explain-memory: the top configuration's rank, line by line, tensors and the pages that are no tensor's.
    assert "memory per rank of pipeline" in output and "pipeline rings' pages" in output, output
    assert "tensors (the allocator's peak)" in output and "resident only" in output


def test_a_wide_embedding_over_the_memory_cap_goes_to_the_parameter_server(tmp_path):
    # ~49 MiB of embedding trained with Adam: DDP holds 5 copies of it, a pipeline stage (it cannot be cut) 4;
    # the parameter server keeps it as sparse rows, each of 2 servers half of it with Adam's state (grown by
    # doubling: up to 3.5 x its half rounded up to a power of two), a worker only the rows its samples touch. ZeRO does not fit: the table is one parameter, one bucket (stage 3:
    # one unit), whose gradient and flat copy for the reduce-scatter a rank holds at once beside the table.
    report, output = plan(tmp_path, "wide_embedding", "--batch", 60, "--world", 4, "--memory-per-rank", "120MiB")
    assert report["ranked"], output
    assert {p["fields"]["strategy"] for p in report["ranked"]} == {"ps"}, output
    assert all(p["fields"]["servers"] == 2 for p in report["ranked"])
    reasons = {e["configuration"]: e["reason"] for e in report["excluded"]}
    for stage in (1, 2, 3):
        assert "over the 120.0 MiB cap" in reasons[f"sharded zero-{stage}, 4 replicas"], reasons
    assert "over the 120.0 MiB cap" in reasons["ps bsp, 3 workers + 1 server"], reasons
    assert "torchpar.ps.ParameterService(servers=2" in output
    assert "torchpar.ps.Embedding(service.client" in output and "torchpar::ps::Embedding" in output


def test_what_does_not_divide_is_excluded_by_name(tmp_path):
    # With the pipeline's rings turned off (its messages through the group) the planner costs its transfers as
    # the group's send/recv.
    report, output = plan(tmp_path, "digits_mlp", "--batch", 10, "--world", 3, TORCHPAR_PIPELINE_RING_BYTES="0")
    reasons = {e["configuration"]: e["reason"] for e in report["excluded"]}
    assert reasons["ddp, 3 replicas"] == "batch 10 does not divide into 3 ranks"
    assert "the model has 2 layers, fewer than the 3 stages" in reasons.values()
    assert "stage_transfer" not in report["network"] and "between stages through the group" in output


def test_verify_runs_the_top_configurations_and_reports_them(tmp_path):
    import torch
    from torchpar._C import plan as engine
    from torchpar.plan.calibration import calibration_fields

    report, output = plan(tmp_path, "digits_mlp", "--batch", 64, "--world", 2, "--verify", 2,
                          "--verify-each-strategy", "--steps", 3)
    assert len(report["verified"]) >= 4, output  # the top 2 and the best of every strategy
    strategies = {row["configuration"].split()[0].rstrip(",") for row in report["verified"]}
    # tensor: the MLP's Linear layers split; sharded: the best ZeRO stage
    assert strategies == {"ddp", "sharded", "pipeline", "ps", "tensor"}, output
    for row in report["verified"]:
        assert row["measured_ms"] > 0 and row["predicted_ms"] > 0 and row["calibrated_ms"] > 0
        assert row["measured_memory"] >= 0 and row["predicted_memory"] > 0
    # Memory measured as the resident set's growth: the model is small (38 KiB of parameters) and may land in
    # memory an earlier configuration freed, but a parameter server's channels and buffers do not.
    assert next(r for r in report["verified"] if r["configuration"].startswith("ps"))["measured_memory"] > 0
    # Before any --verify, what the engines cost was measured on these ranks (DDP, pipeline and parameter-server
    # probes), not left at the zero host time of a bare calibration. (The parameter server's time per step may
    # come out zero where the communication x fitted before it already accounts for its tiny probe.)
    assert report["calibration"]["per_action_ms"] > 0, output
    assert report["machine_drift"] >= 1.0  # how far the machine's speed moved during the verification
    # The pipeline's transfers between the ranks of this host were measured through its rings, as it sends them.
    assert len(report["network"]["stage_transfer"]) == 2 and "between stages through same-host rings" in output
    assert "predicted against measured" not in output  # the plot's title, not stdout
    assert "verified (step ms)" in output and "the top-ranked configuration measured" in output
    # What it learned is kept for the next plan on this machine, which says it uses it, with every verified
    # configuration as a sample that later --verify runs refit with theirs.
    store = engine.CalibrationStore(str(tmp_path / "calibration.pt"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # kept under the ranks' thread count, as each rank runs
    try:
        kept = store.samples(2, "gloo")
        learned = store.calibration(2, "gloo")
    finally:
        torch.set_num_threads(threads)
    assert calibration_fields(learned) == report["learned_calibration"]
    # The runs that measured the host times are samples too (DDP, a pipeline, parameter servers of two sizes and
    # of an embedding's sparse rows).
    assert report["probe_samples"] == 5
    assert len(kept) == len(report["verified"]) + 5 == report["calibration_samples"]
    # DDP's buckets go through the same-host shm group beside Gloo, and are costed so; the DDP probe that fits
    # the group's collectives under load (communication x) all-reduces through the group itself, and its sample
    # says so (fitted to the shm group's all-reduce, too cheap to tell a scale from, it ran into its bound).
    assert "ddp_all_reduce" in report["network"], output
    ddp_samples = [sample for sample in kept if sample.configuration.strategy == engine.Strategy.ddp]
    probe = [sample for sample in ddp_samples if len(sample.model.layers) == 4]
    verified = [sample for sample in ddp_samples if len(sample.model.layers) != 4]
    assert len(probe) == 1 and probe[0].network.ddp_all_reduce is None, ddp_samples
    assert verified and all(sample.network.ddp_all_reduce is not None for sample in verified)
    again_report, again = plan(tmp_path, "digits_mlp", "--batch", 64, "--world", 2, "--verify", 1, "--steps", 2)
    assert "calibration from earlier --verify runs" in again
    assert again_report["calibration"] == report["learned_calibration"]
    assert again_report["calibration_samples"] == report["calibration_samples"] + 5 + 1
    # A plan without --verify that has a learned calibration does not measure the host times it would not use.
    _, plain = plan(tmp_path, "digits_mlp", "--batch", 64, "--world", 2)
    assert "calibration from earlier --verify runs" in plain
    assert "the engines' host time, measured" not in plain and "the engines' host time, measured" in again


def test_a_calibration_sample_survives_the_file_and_refits_the_same(tmp_path):
    import torchpar.plan as planner
    from torchpar._C import plan as engine
    from torchpar.plan import calibration

    model = planner.load_model("torchpar.plan.examples:deep_mlp")
    profile, optimizer_ms_per_byte = planner.profile(model, 8, repeats=1)
    profile.contention = 1.7
    network = engine.NetworkProfile()
    network.all_reduce.alpha_ms, network.all_reduce.ms_per_byte = 0.5, 1e-6
    network.send_recv.alpha_ms, network.send_recv.ms_per_byte = 0.1, 5e-7
    network.copy.ms_per_byte = 1e-7
    ring = engine.LinkCost()
    ring.alpha_ms, ring.ms_per_byte = 0.02, 2e-7
    network.stage_transfer = ring
    samples = []
    for strategy, fields in (("ddp", {}), ("pipeline", dict(microbatches=2, schedule="zero_bubble")),
                             ("ps", dict(servers=1))):
        configuration = engine.Configuration()
        configuration.strategy, configuration.world = getattr(engine.Strategy, strategy), 2
        for name, value in fields.items():
            setattr(configuration, name, value)
        predicted = planner.predict_step_ms(model, profile, network, configuration, batch=16,
                                            optimizer_ms_per_byte=optimizer_ms_per_byte)
        samples.append(planner.calibration_sample(model, profile, network, configuration, batch=16,
                                                  optimizer_ms_per_byte=optimizer_ms_per_byte,
                                                  measured_ms=1.3 * predicted))
    path = tmp_path / "calibration.pt"
    learned, count = calibration.learn(samples, 2, "gloo", path)
    assert count == 3
    restored = calibration.CalibrationStore(str(path)).samples(2, "gloo")
    assert len(restored) == 3
    for original, copy in zip(samples, restored):
        assert copy.configuration.describe() == original.configuration.describe()
        assert copy.model.contention == 1.7 and copy.network.copy.ms_per_byte == 1e-7
        assert copy.network.stage_transfer.alpha_ms == 0.02 and copy.network.ddp_all_reduce is None
        assert copy.measured_ms == original.measured_ms
        # The same prediction from the copy as from the original: nothing the cost model reads was lost.
        for original_layer, copied_layer in zip(original.model.layers, copy.model.layers):
            assert copied_layer.in_features == original_layer.in_features
            assert copied_layer.backward_temporary_bytes == original_layer.backward_temporary_bytes
        assert (engine.predict(copy.model, copy.network, copy.setup, copy.configuration).step_ms ==
                engine.predict(original.model, original.network, original.setup, original.configuration).step_ms)
    for sample in samples:  # the fit learned the 30% the "measurements" added
        fitted = engine.predict(sample.model, sample.network, sample.setup, sample.configuration, learned).step_ms
        assert abs(fitted - sample.measured_ms) / sample.measured_ms < 0.08
    again, count = calibration.learn([], 2, "gloo", path)  # read back from the file, refitted the same
    assert count == 3
    assert calibration.calibration_fields(again) == calibration.calibration_fields(learned)
    assert calibration.load_calibration(2, "gloo", path).compute_scale == learned.compute_scale
    assert calibration.load_calibration(3, "gloo", path) is None  # kept per world (and backend)
    # torch.load reads the store (torch's pickle format): one entry for this torch, backend, world and threads.
    import torch
    assert list(torch.load(path, weights_only=False)) == [engine.calibration_key(2, "gloo")]
    # A file that is not a store (an older torchpar's JSON) is refused naming it, not overwritten.
    stale = tmp_path / "old.json"
    stale.write_text("{}")
    try:
        calibration.learn(samples, 2, "gloo", stale)
    except RuntimeError as error:
        assert "is not one" in str(error) and str(stale) in str(error)
    else:
        raise AssertionError("a JSON file was taken for a calibration store")
    assert stale.read_text() == "{}"


def test_a_file_that_is_no_calibration_store_stops_every_rank_saying_so(tmp_path):
    """Rank 0 alone reads the store: where the file is not one (an older torchpar's JSON), the plan stops on every
    rank, naming the file, instead of leaving the other ranks waiting for rank 0."""
    stale = tmp_path / "old.json"
    stale.write_text("{}")
    result = subprocess.run([sys.executable, "-m", "torchpar.plan", "--model", "torchpar.plan.examples:digits_mlp",
                             "--batch", "64", "--world", "2", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300,
                            env=clean_env(TORCHPAR_PLAN_CALIBRATION=str(stale)))
    assert result.returncode != 0
    assert f"{stale} is not one" in result.stderr, result.stderr[-3000:]
    assert stale.read_text() == "{}"


def test_the_host_overhead_is_where_the_prediction_meets_the_measurement():
    from torchpar.plan.host_overhead import _solve

    def predicted(per_action_ms):
        return 1.0 + 3.0 * per_action_ms

    assert abs(_solve(predicted, 2.5, 2.0) - 0.5) < 1e-6
    assert _solve(predicted, 0.5, 2.0) == 0.0  # measured below the prediction without any: none
    assert abs(_solve(predicted, 100.0, 2.0) - 2.0) < 1e-6  # capped at the calibration's bound


def test_quick_configurations_are_verified_over_more_steps():
    from torchpar.plan.cli import timed_steps

    assert timed_steps(100.0, 5) == (2, 5)    # slow steps: --steps of them
    assert timed_steps(20.0, 8) == (3, 13)    # ~0.25 s of steps, a quarter as many first untimed
    assert timed_steps(2.0, 5) == (12, 50)    # quick steps: at most 50
    assert timed_steps(0.0, 5) == (12, 50)


def test_the_machine_drifting_during_the_verification_is_measured():
    from types import SimpleNamespace

    from torchpar.plan.cli import machine_drift

    def passes(alone, together):
        return SimpleNamespace(alone_ms=alone, together_ms=together)

    assert machine_drift(passes(7.0, 7.4), passes(7.0, 7.4)) == 1.0
    assert machine_drift(passes(7.0, 7.4), passes(11.05, 9.9)) == 11.05 / 7.0   # slower after
    assert machine_drift(passes(8.0, 16.0), passes(8.0, 8.0)) == 2.0            # faster after, together
