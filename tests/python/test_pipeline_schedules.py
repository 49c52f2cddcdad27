"""The pipeline schedules as data, without processes: every schedule forms a complete, deadlock-free
step whose bubble and activation memory match the closed forms, the simulator rejects broken action
lists, the layer partitioner finds the optimum, and the show CLI prints and plots a schedule."""
import collections
import itertools
import random
import re
import subprocess
import sys

import pytest

from torchpar._C import pipeline as engine

SCHEDULES = tuple(engine.schedule_names())
ActionType = engine.ActionType


def shapes(schedule):
    """(ranks, micro-batches, virtual stages) to sweep: interleaved needs m to be a multiple of p."""
    if schedule == "interleaved":
        yield from ((p, m, 2) for p in range(1, 9) for m in range(p, 33, p))
        yield from ((p, m, v) for v in (1, 3, 4) for p in (1, 2, 3, 4, 8) for m in (p, 2 * p, 4 * p))
    else:
        yield from ((p, m, 1) for p in range(1, 9) for m in range(1, 33))


def parse(text):
    """Actions in the engine's own notation: "F0@s1 SEND_F0@s1" is micro-batch 0 on stage 1."""
    actions = []
    for word in text.split():
        match = re.fullmatch(r"([A-Z_]+?)(\d+)@s(\d+)", word)
        assert match, word
        actions.append(engine.Action(getattr(ActionType, match[1]), int(match[3]), int(match[2])))
    return actions


# --- every schedule is a complete, deadlock-free step ---------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_runs_each_forward_and_backward_exactly_once(schedule):
    backward_types = ("I", "W") if schedule == "zero_bubble" else ("B",)
    for p, m, v in shapes(schedule):
        shape = f"{schedule} p={p} m={m} v={v}"
        simulation = engine.simulate(schedule, p, m, v)  # raises on an incomplete or deadlocked step
        assert (simulation.ranks, simulation.stages, simulation.microbatches) == (p, p * v, m), shape
        runs = collections.Counter()
        for rank, row in enumerate(simulation.timeline):
            actions = [timed.action for timed in row]
            assert actions == engine.compute_actions(schedule, p, m, v, rank), f"{shape} rank {rank}"
            assert all(action.stage % p == rank for action in actions), f"{shape} rank {rank}: {actions}"
            assert all(earlier.end <= later.start for earlier, later in zip(row, row[1:])), f"{shape} rank {rank}"
            runs.update((action.type.name, action.stage, action.microbatch) for action in actions)
        expected = {(kind, stage, microbatch): 1 for kind in ("F", *backward_types)
                    for stage in range(p * v) for microbatch in range(m)}
        assert runs == expected, shape


def test_rank_actions_add_a_receive_before_and_a_send_after_each_remote_transfer():
    assert engine.rank_actions("1f1b", 2, 2, 1, 0) == parse(
        "F0@s0 SEND_F0@s0 RECV_B0@s0 F1@s0 SEND_F1@s0 RECV_B1@s0 B0@s0 B1@s0")
    assert engine.rank_actions("1f1b", 2, 2, 1, 1) == parse(
        "RECV_F0@s1 F0@s1 RECV_F1@s1 B0@s1 SEND_B0@s1 F1@s1 B1@s1 SEND_B1@s1")
    # A gradient's receive is sized by its activation, so it is posted only after sending that.
    assert engine.rank_actions("1f1b", 2, 1, 1, 0) == parse("F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0")
    assert repr(engine.Action(ActionType.SEND_B, 1, 3)) == "SEND_B3@s1"


def test_schedule_names_accept_the_documented_aliases():
    for alias, name in [("1F1B", "1f1b"), ("interleaved_1f1b", "interleaved"), ("zb_h1", "zero_bubble"),
                        ("zero-bubble", "zero_bubble")]:
        assert engine.rank_actions(alias, 4, 8, 1, 2) == engine.rank_actions(name, 4, 8, 1, 2), alias


# --- bubble closed forms ----------------------------------------------------------------------------

COSTS = [pytest.param(1.0, 2.0, id="default"), pytest.param(1.0, 1.0, id="B=F"), pytest.param(1.5, 4.0, id="B>2F")]


@pytest.mark.parametrize("forward, backward", COSTS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule, forward, backward):
    for p, m, _ in shapes(schedule):
        simulation = engine.simulate(schedule, p, m, forward=forward, backward=backward)
        assert simulation.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9), (p, m)
        assert simulation.makespan == pytest.approx((m + p - 1) * (forward + backward)), (p, m)


@pytest.mark.parametrize("forward, backward", COSTS)
def test_interleaved_bubble_shrinks_by_the_virtual_stages(forward, backward):
    """Exactly (p-1)/(v*m+p-1) for every m that is a multiple of p, with per-chunk costs F and B."""
    for p, m, v in shapes("interleaved"):
        simulation = engine.simulate("interleaved", p, m, v, forward=forward, backward=backward)
        assert simulation.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9), (p, m, v)
        assert simulation.makespan == pytest.approx((v * m + p - 1) * (forward + backward)), (p, m, v)


def test_zero_bubble_with_equal_passes_idles_a_third_of_1f1bs_time():
    for p, m, _ in shapes("zero_bubble"):
        simulation = engine.simulate("zero_bubble", p, m, forward=1.0, backward_input=1.0, backward_weight=1.0)
        if m >= p:
            assert simulation.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-9), (p, m)
        else:
            # Too few micro-batches to fill the ramp: rank 0 starts I0 at 2p-1, the later I reach it
            # 2 apart and each is followed by its W, so the step takes 2p-1+2m.
            assert simulation.makespan == pytest.approx(2 * m + 2 * p - 1), (p, m)
        if p >= 2:
            one_f_one_b = engine.simulate("1f1b", p, m, forward=1.0, backward=2.0).bubble_fraction
            assert simulation.bubble_fraction < one_f_one_b, (p, m)


def test_zero_bubble_closed_form_for_weight_passes_no_slower_than_forward_and_input_passes():
    """ZB-H1's makespan m(F+I+W) + (p-1)(F+I-W) (Qi et al. 2023) for m >= p and W <= min(F, I)."""
    for forward, inputs, weight in itertools.product((0.5, 1.0, 2.0, 3.0), repeat=3):
        if weight > min(forward, inputs):
            continue
        for p in range(2, 7):
            for m in range(p, 3 * p + 1):
                simulation = engine.simulate("zero_bubble", p, m, forward=forward, backward_input=inputs,
                                             backward_weight=weight)
                idle = (p - 1) * (forward + inputs - weight)
                assert simulation.makespan == pytest.approx(m * (forward + inputs + weight) + idle), (
                    forward, inputs, weight, p, m)


# --- activation memory ------------------------------------------------------------------------------


def test_gpipe_keeps_every_micro_batch_alive_on_every_rank():
    for p, m, _ in shapes("gpipe"):
        assert engine.simulate("gpipe", p, m).peak_activations == [m] * p, (p, m)


def test_1f1b_rank_r_keeps_at_most_p_minus_r_micro_batches():
    for p, m, _ in shapes("1f1b"):
        peaks = engine.simulate("1f1b", p, m).peak_activations
        assert peaks == [min(p - rank, m) for rank in range(p)], (p, m)
        assert max(peaks) <= p


def test_zero_bubble_keeps_no_more_than_1f1bs_first_rank():
    for p, m, _ in shapes("zero_bubble"):
        peaks = engine.simulate("zero_bubble", p, m).peak_activations
        # A rank frees activations at W, and rank r defers r of them: every rank holds 1F1B's rank-0 peak.
        assert peaks == [min(p, m)] * p, (p, m)
        assert max(peaks) <= p


# --- simulate_actions rejects broken lists ----------------------------------------------------------

P, M = 4, 8


def schedule_lists(schedule="1f1b"):
    return [engine.rank_actions(schedule, P, M, 1, rank) for rank in range(P)]


def test_simulate_actions_of_the_schedules_lists_equals_simulate():
    for schedule in SCHEDULES:
        simulation = engine.simulate_actions(schedule_lists(schedule), P, M)
        assert simulation.makespan == engine.simulate(schedule, P, M).makespan, schedule


@pytest.mark.parametrize("schedule, rank, removed, message", [
    pytest.param("1f1b", 1, "B2@s1", "no backward of stage 1, micro-batch 2", id="backward"),
    pytest.param("1f1b", 0, "SEND_F1@s0", "the activation of stage 0, micro-batch 1 is not both sent and received",
                 id="send"),
    pytest.param("1f1b", 3, "RECV_F5@s3", "the activation of stage 2, micro-batch 5 is not both sent and received",
                 id="receive"),
    pytest.param("1f1b", 0, "RECV_B3@s0",
                 "the input gradient of stage 1, micro-batch 3 is not both sent and received", id="gradient-receive"),
    pytest.param("1f1b", 2, "F7@s2", "no forward of stage 2, micro-batch 7", id="forward"),
    pytest.param("zero_bubble", 2, "W5@s2", "I without W of stage 2, micro-batch 5", id="weight-pass"),
])
def test_a_missing_action_is_named(schedule, rank, removed, message):
    lists = schedule_lists(schedule)
    lists[rank].remove(parse(removed)[0])
    with pytest.raises(RuntimeError, match=re.escape(message)):
        engine.simulate_actions(lists, P, M)


def test_a_duplicated_action_is_named():
    lists = schedule_lists()
    lists[0].append(parse("F0@s0")[0])
    with pytest.raises(RuntimeError, match=re.escape("F0@s0 appears twice on rank 0")):
        engine.simulate_actions(lists, P, M)


def test_an_action_on_the_wrong_rank_is_named():
    lists = schedule_lists()
    moved = parse("F2@s1")[0]
    lists[1].remove(moved)
    lists[2].insert(0, moved)
    with pytest.raises(RuntimeError, match=re.escape("F2@s1 is listed on rank 2 but stage 1 lives on rank 1")):
        engine.simulate_actions(lists, P, M)


def test_a_backward_swapped_with_its_own_forward_deadlocks():
    lists = schedule_lists()
    forward_at, backward_at = (lists[0].index(action) for action in parse("F0@s0 B0@s0"))
    lists[0][forward_at], lists[0][backward_at] = lists[0][backward_at], lists[0][forward_at]
    with pytest.raises(RuntimeError, match="deadlocks") as error:
        engine.simulate_actions(lists, P, M)
    message = str(error.value)
    assert "rank 0 waits at B0@s0 (action 0 of" in message
    assert "for its forward or stage 1's gradient of micro-batch 0" in message
    # Rank 1 posts micro-batch 1's receive with micro-batch 0's shapes, so it already waits there.
    assert "rank 1 waits at RECV_F1@s1" in message and "for stage 0's send of micro-batch 0" in message


def test_ranks_waiting_on_each_other_deadlock():
    """Rank 0 wants micro-batch 0's gradient before sending micro-batch 1; rank 1 wants both forwards first."""
    lists = [parse("F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0 F1@s0 SEND_F1@s0 RECV_B1@s0 B1@s0"),
             engine.rank_actions("gpipe", 2, 2, 1, 1)]
    with pytest.raises(RuntimeError, match="deadlocks") as error:
        engine.simulate_actions(lists, 2, 2)
    assert "rank 0 waits at B0@s0" in str(error.value)
    assert "rank 1 waits at F1@s1" in str(error.value)


def test_an_action_outside_the_stages_or_micro_batches_is_named():
    lists = schedule_lists()
    lists[0].append(parse(f"F{M}@s0")[0])
    with pytest.raises(RuntimeError, match=re.escape(f"rank 0 has F{M}@s0 outside {P} stages x {M} micro-batches")):
        engine.simulate_actions(lists, P, M)


# --- schedule arguments ---------------------------------------------------------------------------


def test_interleaved_needs_micro_batches_in_groups_of_the_ranks():
    message = re.escape("micro-batches (6) must be a multiple of the pipeline ranks (4)")
    with pytest.raises(RuntimeError, match=message):
        engine.simulate("interleaved", 4, 6, 2)
    with pytest.raises(RuntimeError, match=message):
        engine.compute_actions("interleaved", 4, 6, 2, 0)


def test_unknown_schedule_is_named():
    with pytest.raises(RuntimeError, match="unknown pipeline schedule 'pipedream'"):
        engine.simulate("pipedream", 4, 8)


def test_the_engine_names_the_schedules_that_python_offers():
    import torchpar.pipeline

    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "zero_bubble")
    assert torchpar.pipeline.SCHEDULES == SCHEDULES
    with pytest.raises(RuntimeError, match=re.escape("(gpipe, 1f1b, interleaved, zero_bubble)")):
        engine.simulate("pipedream", 4, 8)


def test_virtual_stages_need_the_interleaved_schedule():
    with pytest.raises(RuntimeError, match=re.escape("virtual_stages=2 needs schedule 'interleaved'")):
        engine.simulate("1f1b", 4, 8, 2)


# --- partitioner -------------------------------------------------------------------------------------


def stage_sums(costs, balance):
    bounds = list(itertools.accumulate(balance, initial=0))
    return [sum(costs[start:end]) for start, end in zip(bounds, bounds[1:])]


def brute_force_slowest_stage(costs, stages):
    slowest = []
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = (0, *cuts, len(costs))
        slowest.append(max(sum(costs[start:end]) for start, end in zip(bounds, bounds[1:])))
    return min(slowest)


def test_balanced_partition_matches_the_brute_force_optimum():
    rng = random.Random(20261130)
    for layers in range(1, 10):
        for stages in range(1, layers + 1):
            for costs in ([rng.uniform(0.1, 10.0) for _ in range(layers)],
                          [float(rng.randint(1, 4)) for _ in range(layers)]):  # ties
                balance = engine.balanced_partition(costs, stages)
                assert len(balance) == stages and min(balance) >= 1 and sum(balance) == layers, (costs, balance)
                assert max(stage_sums(costs, balance)) == pytest.approx(
                    brute_force_slowest_stage(costs, stages)), (costs, stages, balance)


@pytest.mark.parametrize("slow_layer", [0, 4, 9])
def test_a_very_slow_layer_gets_a_stage_of_its_own(slow_layer):
    costs = [1.0] * 10
    costs[slow_layer] = 100.0
    # A layer in the middle needs a stage on either side of it.
    for stages in range(2 if slow_layer in (0, len(costs) - 1) else 3, 6):
        balance = engine.balanced_partition(costs, stages)
        bounds = list(itertools.accumulate(balance, initial=0))
        owner = next(stage for stage in range(stages) if bounds[stage] <= slow_layer < bounds[stage + 1])
        assert balance[owner] == 1, (slow_layer, stages, balance)


def test_uniform_partition_differs_by_at_most_one_layer_earlier_stages_first():
    assert engine.uniform_partition(10, 4) == [3, 3, 2, 2]
    for layers in range(1, 21):
        for stages in range(1, layers + 1):
            balance = engine.uniform_partition(layers, stages)
            assert len(balance) == stages and sum(balance) == layers, (layers, stages, balance)
            assert max(balance) - min(balance) <= 1 and balance == sorted(balance, reverse=True), balance


def test_more_stages_than_layers_is_refused():
    message = re.escape("3 layers cannot fill 4 stages (every stage needs at least one layer)")
    with pytest.raises(RuntimeError, match=message):
        engine.uniform_partition(3, 4)
    with pytest.raises(RuntimeError, match=message):
        engine.balanced_partition([1.0, 2.0, 3.0], 4)


def test_describe_partition_names_layers_and_predicted_cost():
    assert engine.describe_partition([3, 1], [1.0, 1.0, 1.0, 2.5], "ms") == (
        "stage 0: layers 0-2 (3 layers), predicted 3 ms\n"
        "stage 1: layers 3-3 (1 layer), predicted 2.5 ms\n")


# --- python -m torchpar.pipeline.show ----------------------------------------------------------------


def test_show_prints_the_grid_and_writes_the_png(tmp_path):
    png = tmp_path / "x.png"
    result = subprocess.run(
        [sys.executable, "-m", "torchpar.pipeline.show", "1f1b", "--stages", "4", "--microbatches", "8", "--png",
         str(png)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    grid_rows = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert [row.split(" |")[0] for row in grid_rows] == ["rank 0", "rank 1", "rank 2", "rank 3"], result.stdout
    assert engine.simulate("1f1b", 4, 8).grid() in result.stdout
    assert "makespan: 33\n" in result.stdout
    assert "bubble fraction: 0.2727 (simulated); closed form (p-1)/(m+p-1) = 0.2727" in result.stdout
    assert "rank 0: 4, rank 1: 3, rank 2: 2, rank 3: 1" in result.stdout
    assert f"wrote {png}" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_show_names_the_default_png_after_the_schedule(tmp_path, monkeypatch, capsys):
    from torchpar.pipeline import show

    monkeypatch.chdir(tmp_path)
    show.main(["zero_bubble", "--stages", "4", "--microbatches", "8"])
    output = capsys.readouterr().out
    assert "closed form (p-1)(F+I-W)/(m(F+I+W)+(p-1)(F+I-W)) = 0.1111" in output
    assert (tmp_path / "pipeline_zero_bubble_p4_m8.png").stat().st_size > 1000


def test_show_reports_the_engines_refusal_as_a_usage_error(tmp_path, capsys):
    from torchpar.pipeline import show

    with pytest.raises(SystemExit) as exit_info:
        show.main(["interleaved", "--stages", "4", "--microbatches", "6", "--virtual-stages", "2",
                   "--png", str(tmp_path / "never.png")])
    assert exit_info.value.code == 2
    assert "micro-batches (6) must be a multiple of the pipeline ranks (4)" in capsys.readouterr().err
    assert not (tmp_path / "never.png").exists()


def test_per_stage_costs_and_transfers():
    equal = engine.simulate_stages("1f1b", 3, 6, 1, [{"forward": 1.0, "backward": 2.0}] * 3)
    assert equal.makespan == engine.simulate("1f1b", 3, 6).makespan
    # GPipe, 2 stages, stage 1 twice as slow: its forwards run back to back after stage 0's first
    # (1 + 6*2), then its backwards (6*4), then stage 0's last backward (2).
    slow = engine.simulate_stages("gpipe", 2, 6, 1, [{"forward": 1, "backward": 2}, {"forward": 2, "backward": 4}])
    assert slow.makespan == pytest.approx(1 + 6 * 2 + 6 * 4 + 2)
    # Each of the 2(p-1) transfers on the critical path of one micro-batch adds its delay.
    assert engine.simulate("gpipe", 2, 1, transfer=0.5).makespan == pytest.approx(3 * 2 + 2 * 0.5)
    with pytest.raises(RuntimeError, match="2 stage costs for 3 stages"):
        engine.simulate_stages("1f1b", 3, 4, 1, [{}, {}])
    with pytest.raises(RuntimeError, match="unknown cost 'forwards'"):
        engine.simulate_stages("1f1b", 2, 4, 1, [{"forwards": 1.0}, {}])
