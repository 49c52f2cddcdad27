"""benchmarks/sharded.py's tables, targets and plot on rows made up by hand: the ZeRO formula's prediction, which
targets hold, a variant not run, the bytes-sent check, and that python -m torchpar.bench reads only its ratio
columns."""
import sys

from test_torchrun import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import sharded  # noqa: E402

from torchpar import bench  # noqa: E402

PSI = 1_000_000  # parameters
MiB = 1 << 20


def row(world, backend, variant, steps, to_anchor=None, to_ddp=None, state=None, gradients=None, held=None,
        **extra):
    state_predicted, gradients_predicted, parameters_predicted = sharded.predicted_bytes(variant, PSI, world)
    made = dict(world=world, backend=backend, variant=variant, parameters=PSI, description="made up",
                predicted_state_bytes=state_predicted, predicted_gradient_bytes=gradients_predicted,
                predicted_parameter_bytes=parameters_predicted,
                peak_rss_bytes=900 * MiB, peak_rss_bytes_per_rank=[900 * MiB, 850 * MiB],
                steps_per_s=steps, state_bytes=state_predicted if state is None else state,
                gradient_bytes=gradients_predicted if gradients is None else gradients,
                parameter_bytes=parameters_predicted if held is None else held, peak_allocated_bytes=12 * MiB)
    made.update(extra)
    if to_anchor is not None:
        made["ratio_to_anchor"] = to_anchor
    if to_ddp is not None:
        made["ratio_to_ddp"] = to_ddp
    return made


def not_run(made: dict, reason: str) -> dict:
    """A variant that failed on a backend: no rate, ratios or memory, the reason instead (as the benchmark writes)."""
    measured = ("steps_per_s", "state_bytes", "gradient_bytes", "parameter_bytes", "ratio_to_anchor", "ratio_to_ddp")
    return dict({k: v for k, v in made.items() if k not in measured}, not_run=reason)


def rows_for_two_ranks():
    padded = (PSI + 2) * 4  # the shard's padding: 2 elements over the buckets
    sent = 2 * (2 - 1) * padded // 2
    return [
        row(2, "shm", sharded.ANCHOR, 10.0, 1.0, 0.8),
        row(2, "shm", sharded.DDP, 12.5, 1.25, 1.0),
        # Stage 1 holds the parameters' own gradients and the shard's: Ψ + Ψ/2 against the formula's Ψ.
        row(2, "shm", sharded.STAGE1, 12.2, 1.22, 0.97, gradients=1.5 * PSI * 4, ratio_to_fsdp2=1.3,
            bytes_sent_last_step=sent, padded_parameter_bytes=padded),
        row(2, "shm", sharded.STAGE2, 11.0, 1.10, 0.88, bytes_sent_last_step=sent + 4, padded_parameter_bytes=padded),
        not_run(row(2, "shm", sharded.FSDP2, 0.0), "rank 1: RuntimeError: no reduce_scatter | here"),
        # Stage 3: 1.54x DDP's bytes (within 5% of 1.5), 1.25x FSDP2 resharding, holding 1% more than it.
        row(2, "shm", sharded.STAGE3, 8.0, 0.8, 0.64, ratio_to_fsdp2_reshard=1.25, held=PSI * 2 + 80_000,
            bytes_sent_last_step=int(1.54 * 4 * PSI), padded_parameter_bytes=padded),
        row(2, "shm", sharded.FSDP2_RESHARD, 6.4, 0.64, 0.51),
        row(2, "gloo", sharded.ANCHOR, 5.0, 1.0, 0.5),
        row(2, "gloo", sharded.DDP, 10.0, 2.0, 1.0),
        row(2, "gloo", sharded.STAGE1, 4.9, 0.98, 0.49),
        not_run(row(2, "gloo", sharded.STAGE2, 0.0), "rank 0: ValueError: made up"),
        # Stage 3 sends 1.6x DDP's bytes; its anchor did not run.
        row(2, "gloo", sharded.STAGE3, 4.0, 0.8, 0.4, bytes_sent_last_step=int(1.6 * 4 * PSI),
            padded_parameter_bytes=padded),
        not_run(row(2, "gloo", sharded.FSDP2_RESHARD, 0.0), "rank 0: RuntimeError: made up"),
    ]


def test_the_zero_formula_per_rank():
    # Adam in fp32 on 4 ranks: DDP holds 2Ψ of state, Ψ of gradients and Ψ of parameters; stage 1 a quarter of
    # the state; stage 2 a quarter of the state and the gradients; stage 3 (and FSDP2, whose parameters are
    # sharded between steps whether or not it reshards after forward) a quarter of all three; torch's ZeRO under
    # DDP is stage 1.
    assert sharded.predicted_bytes(sharded.DDP, PSI, 4) == (8 * PSI, 4 * PSI, 4 * PSI)
    assert sharded.predicted_bytes(sharded.STAGE1, PSI, 4) == (2 * PSI, 4 * PSI, 4 * PSI)
    assert sharded.predicted_bytes(sharded.ANCHOR, PSI, 4) == (2 * PSI, 4 * PSI, 4 * PSI)
    assert sharded.predicted_bytes(sharded.STAGE2, PSI, 4) == (2 * PSI, PSI, 4 * PSI)
    assert sharded.predicted_bytes(sharded.STAGE3, PSI, 4) == (2 * PSI, PSI, PSI)
    assert sharded.predicted_bytes(sharded.FSDP2, PSI, 4) == (2 * PSI, PSI, PSI)
    assert sharded.predicted_bytes(sharded.FSDP2_RESHARD, PSI, 4) == (2 * PSI, PSI, PSI)


def test_which_targets_hold_and_a_stage_not_run_fails_its_own():
    checks = {t.name: t for t in sharded.sharded_targets(rows_for_two_ranks())}
    # 2 stages x 2 backends x (against torchpar's DDP, against torch's ZeRO); stage 3 x 2 backends x (speed and
    # memory against FSDP2 resharding)
    assert len(checks) == 12
    assert checks["torchpar stage 1, 2 ranks shm: /torchpar DDP >= 0.95"].holds  # 0.97
    assert checks["torchpar stage 1, 2 ranks shm: /torch ZeRO+DDP >= 1"].holds  # 1.22
    assert not checks["torchpar stage 2, 2 ranks shm: /torchpar DDP >= 0.95"].holds  # 0.88
    assert checks["torchpar stage 2, 2 ranks shm: /torch ZeRO+DDP >= 1"].measured == "1.10"
    assert not checks["torchpar stage 1, 2 ranks gloo: /torch ZeRO+DDP >= 1"].holds  # 0.98
    not_run = checks["torchpar stage 2, 2 ranks gloo: /torchpar DDP >= 0.95"]
    assert (not_run.measured, not_run.holds) == ("not run", False)
    assert checks["torchpar stage 3, 2 ranks shm: /torch FSDP2 reshard >= 1.2"].holds  # 1.25
    # (2Ψ/2 + Ψ/2 + Ψ/2) x 4 bytes = 8 MB held by both, ours 80 kB more: 1.01
    memory = checks["torchpar stage 3, 2 ranks shm: memory held / torch FSDP2 reshard's <= 1.01"]
    assert (memory.measured, memory.holds) == ("1.01", True)
    # Stage 3's anchor did not run on gloo: both its targets fail.
    assert not checks["torchpar stage 3, 2 ranks gloo: /torch FSDP2 reshard >= 1.2"].holds
    assert checks["torchpar stage 3, 2 ranks gloo: memory held / torch FSDP2 reshard's <= 1.01"].measured == "not run"


def test_tables_show_memory_against_the_prediction_and_the_bytes_check():
    rows = rows_for_two_ranks()
    table = sharded.table(rows)
    # Stage 1 on 2 ranks: state Ψ of 2Ψ x 4 bytes / 2 = 3.81 MiB as predicted; gradients 5.72 MiB against 3.81.
    # Parameters: Ψ x 4 bytes whole = 3.81 MiB; stage 3 holds half, plus 80 kB.
    assert ("| 2 | shm | torchpar stage 1 | 12.20 | 1.22 | 0.97 | 1.30 | 3.81 (3.81) | 5.72 (3.81) "
            "| 3.81 (3.81) | 12.00 |") in table
    assert ("| 2 | shm | torchpar DDP | 12.50 | 1.25 | 1.00 | — | 7.63 (7.63) | 3.81 (3.81) | 3.81 (3.81) "
            "| 12.00 |") in table
    assert ("| 2 | shm | torchpar stage 3 | 8.00 | 0.80 | 0.64 | 1.25 | 3.81 (3.81) | 1.91 (1.91) "
            "| 1.98 (1.91) | 12.00 |") in table
    # A variant not run says why, without breaking the table's columns.
    assert ("| 2 | shm | torch FSDP2 | not run: rank 1: RuntimeError: no reduce_scatter / here "
            "| — | — | — | — | — | — | — |") in table
    sent = sharded.sent_bytes_table(rows)
    assert ("| 2 | shm | torchpar stage 1 | 4,000,008 | 4,000,000 | 1.000 | 4,000,008 bytes (padded) | yes |"
            in sent)
    assert "| 2 | shm | torchpar stage 2 | 4,000,012 | 4,000,000 | 1.000 | 4,000,008 bytes (padded) | no |" in sent
    assert "| 2 | shm | torchpar stage 3 | 6,160,000 | 4,000,000 | 1.540 | 1.5 within 5% | yes |" in sent
    assert "| 2 | gloo | torchpar stage 3 | 6,400,000 | 4,000,000 | 1.600 | 1.5 within 5% | no |" in sent
    assert "| 2 | 900.00 | 850.00 |" in sent


def test_the_plot_draws_rows_not_run(tmp_path):
    sharded.plot(rows_for_two_ranks(), tmp_path / "sharded.png")
    assert (tmp_path / "sharded.png").stat().st_size > 10_000


def test_the_bench_report_compares_only_the_ratio_columns():
    found = bench.ratios("sharded", bench.tables_in(sharded.table(rows_for_two_ranks())))
    assert found and all(key.endswith(("| /torch ZeRO+DDP", "| /torchpar DDP", "| /torch FSDP2 alike"))
                         for key in found), found
    assert found["sharded #1 row 3: 2 | /torchpar DDP"] == 0.97
    assert found["sharded #1 row 3: 2 | /torch FSDP2 alike"] == 1.3
    # 10 rows run, 2 ratios each, and the FSDP2 column of stage 1 and stage 3 on shm (the rest "—": no FSDP2 alike
    # measured, or not a stage)
    assert not any("not run" in key for key in found) and len(found) == 2 * 10 + 2
