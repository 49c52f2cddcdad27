"""The parameter service under failures: checkpoints survive kill -9 and restore exactly, lost and silent
workers are dropped while the others go on, a dead server is reported to every worker, and malformed
requests cost their sender an error, nothing more.

Ranks die for real (kill -9 of their own process) under launch_ranks, which reports the dead rank and lets
the others finish. Gradients are fixed functions of (step, worker), so runs compare bit for bit (BSP: each
round applies the workers' mean in worker order) or against exact arithmetic (integer-valued SGD).
"""
import os
import pathlib
import random
import time
import types

import pytest
import torch

from ps_helpers import (DTYPE_CODE, Kind, PsLog, checkpoint_files, dense_payload, error_of, kill_self,
                        kill_self_when, load_checkpoint, rows_payload, touch, wait_for)
from rank_harness import launch_ranks

import torchpar.ps as ps

# Rank deadlines are generous: the machine may be shared by other test runs.
DEADLINE_S = 150
TIMEOUT_S = 60  # the service's timeout where no test waits for it


def outcome_values(outcomes, ranks):
    """The values of ``ranks``, which must have passed."""
    for rank in ranks:
        assert outcomes[rank].passed, outcomes[rank].message
    return [outcomes[rank].value for rank in ranks]


def assert_killed(outcome):
    assert not outcome.passed and "killed by signal 9" in outcome.message, outcome.message


def assert_bitwise_equal(got, expected, what):
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    assert torch.equal(got, expected), f"{what}: max difference {(got - expected).abs().max().item()}"


def listing(directory):
    return sorted(path.name for path in pathlib.Path(directory).iterdir())


# --- Checkpoints: an Adam dense table and an Adagrad sparse table over 2 servers, 2 workers. ---

SHAPE = (5, 3)  # 15 elements: 7 on server 0, 8 on server 1
NUM_ROWS, DIM = 40, 4
K = 3  # steps before the checkpoint, and again after the restart
ALL_ROWS = torch.arange(NUM_ROWS)


def register_tables(client):
    initial = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    w = client.dense_table("w", initial, ps.Adam(lr=0.05))
    e = client.sparse_table("e", NUM_ROWS, DIM, ps.Adagrad(lr=0.1), ps.uniform(-0.5, 0.5, seed=11))
    return w, e


def gradients(step, worker):
    generator = torch.Generator().manual_seed(1000 * step + worker)
    ids = torch.randint(0, NUM_ROWS, (6,), generator=generator)
    return torch.randn(SHAPE, generator=generator), ids, torch.randn(6, DIM, generator=generator)


def train(client, w, e, steps, worker):
    for step in steps:
        grad, ids, rows = gradients(step, worker)
        values = client.push_pull([w], [grad])
        client.push_rows([e], [ids], [rows]).wait()
        values.wait()


def state(client, w, e):
    """The tables as this worker pulls them (every row of the sparse one), and its clocks."""
    dense = client.pull([w]).wait()[0]
    rows = client.pull_rows([e], [ALL_ROWS]).wait()[0]
    return dict(dense=dense, rows=rows, clocks=(client.clock(w), client.clock(e)))


def two_by_two(consistency, directory=None):
    return ps.ParameterService(servers=2, consistency=consistency, staleness=1, checkpoint_dir=directory,
                               timeout=TIMEOUT_S, stats_interval=3600)


def train_checkpoint_then_die(rank, directory, flags, consistency, victim):
    """Job 1: K steps, client.checkpoint(), the values as pulled; then rank ``victim`` dies (kill -9)."""
    service = two_by_two(consistency, directory)
    if service.is_server:
        if rank == victim:
            kill_self_when(flags / "kill-server", dying=flags / "server-dying")
        return service.serve()
    client = service.client
    w, e = register_tables(client)
    train(client, w, e, range(K), service.worker_index)
    client.checkpoint()
    files = [load_checkpoint(path) for path in checkpoint_files(directory, 2)]  # on disk once it returned
    values = state(client, w, e)
    if rank == victim:
        kill_self()
    if victim >= service.num_workers:  # a server dies: wait until it did, so it cannot write at its end
        # Only once every worker has pulled: a server killed under another worker's pull fails that pull.
        touch(flags / f"pulled-{service.worker_index}")
        if service.worker_index == 0:
            for worker in range(service.num_workers):
                wait_for(flags / f"pulled-{worker}")
            touch(flags / "kill-server")
        wait_for(flags / "server-dying")
        time.sleep(0.5)
    service.finish()
    return values, files


def uninterrupted():
    """The reference: 2K steps without a stop (BSP, no checkpoint)."""
    service = two_by_two("bsp")
    if service.is_server:
        return service.serve()
    client = service.client
    w, e = register_tables(client)
    train(client, w, e, range(2 * K), service.worker_index)
    values = state(client, w, e)
    service.finish()
    return values


def ssp_job(rank, world, directory, flags):
    return train_checkpoint_then_die(rank, pathlib.Path(directory), pathlib.Path(flags), "ssp", victim=1)


def bsp_jobs(rank, world, directory, flags):
    reference = uninterrupted()
    return reference, train_checkpoint_then_die(rank, pathlib.Path(directory), pathlib.Path(flags), "bsp",
                                                victim=3)


def restart(consistency, directory, continue_training):
    """Job 2: the same tables over the same checkpoint directory; then, optionally, K more steps."""
    service = two_by_two(consistency, directory)
    if service.is_server:
        return service.serve()
    client = service.client
    w, e = register_tables(client)
    restored = state(client, w, e)
    continued = None
    if continue_training:
        train(client, w, e, range(K, 2 * K), service.worker_index)
        continued = state(client, w, e)
    service.finish()
    return restored, continued


def restart_both(rank, world, ssp_directory, bsp_directory):
    return restart("ssp", ssp_directory, False), restart("bsp", bsp_directory, True)


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """Job 1 under SSP (worker 1 dies after the checkpoint) and under BSP (server 1 dies after it, following
    an uninterrupted reference run of 2K steps); then both restart in one launch."""
    directories = {name: tmp_path_factory.mktemp(name) for name in ("ssp", "bsp", "ssp-flags", "bsp-flags")}
    options = dict(deadline_s=DEADLINE_S, collective_timeout_s=TIMEOUT_S, grace_s=DEADLINE_S)
    ssp = launch_ranks(4, ssp_job, str(directories["ssp"]), str(directories["ssp-flags"]), **options)
    bsp = launch_ranks(4, bsp_jobs, str(directories["bsp"]), str(directories["bsp-flags"]), **options)
    listings = {name: listing(directories[name]) for name in ("ssp", "bsp")}
    restarted = launch_ranks(4, restart_both, str(directories["ssp"]), str(directories["bsp"]),
                             deadline_s=DEADLINE_S, collective_timeout_s=TIMEOUT_S)
    return types.SimpleNamespace(ssp=ssp, bsp=bsp, listings=listings, restarted=restarted)


def assert_checkpoint_holds(files, values):
    """Both servers' files hold the pulled values (dense: the shards in order; sparse: rows by id), clock K."""
    dense = torch.cat([next(t for t in f["tables"] if t["name"] == "w")["values"] for f in files])
    assert_bitwise_equal(dense, values["dense"].view(-1), "the dense table in the checkpoint files")
    for f in files:
        assert f["format"] == "torchpar.ps" and f["servers"] == 2 and f["workers"] == 2
        sparse = next(t for t in f["tables"] if t["name"] == "e")
        assert_bitwise_equal(sparse["values"], values["rows"][sparse["ids"]], "sparse rows in the checkpoint")
        assert len(sparse["ids"]) > 0
        for table in f["tables"]:
            assert list(table["pushes"]) == [K, K], table["name"]


def test_checkpoint_returns_once_every_server_wrote_its_whole_file(checkpointed):
    (ssp_values, ssp_files), = outcome_values(checkpointed.ssp, [0])
    assert_checkpoint_holds(ssp_files, ssp_values)
    (_, (bsp_values, bsp_files)), = outcome_values(checkpointed.bsp, [0])
    assert_checkpoint_holds(bsp_files, bsp_values)
    # Written under a temporary name, then renamed: nothing else is left in the directory.
    for name in ("ssp", "bsp"):
        assert checkpointed.listings[name] == ["server-0-of-2.pt", "server-1-of-2.pt"], checkpointed.listings


def test_a_worker_killed_after_the_checkpoint_is_dropped_and_the_restart_restores_exactly(checkpointed):
    assert_killed(checkpointed.ssp[1])
    (values, _), stats0, stats1 = outcome_values(checkpointed.ssp, [0, 2, 3])
    assert values["clocks"] == (K, K)
    assert stats0["lost_workers"] == [1] and stats1["lost_workers"] == [1]
    for (restored, _), _ in outcome_values(checkpointed.restarted, [0, 1]):
        assert_bitwise_equal(restored["dense"], values["dense"], "dense values after the restart")
        assert_bitwise_equal(restored["rows"], values["rows"], "sparse rows after the restart")
        assert restored["clocks"] == (K, K)


def test_a_server_killed_after_the_checkpoint_restarts_exactly_and_resumes_as_if_never_stopped(checkpointed):
    assert_killed(checkpointed.bsp[3])
    (reference, (values, _)), (_, (values1, _)), (_, stats0) = outcome_values(checkpointed.bsp, [0, 1, 2])
    # Having seen server 1 die, the workers leave without a clean finish: server 0 counts them lost and
    # keeps the checkpoint of client.checkpoint() instead of writing one at the end.
    assert sorted(stats0["lost_workers"]) == [0, 1]
    assert_bitwise_equal(values1["dense"], values["dense"], "the two workers' pulls")
    assert values["clocks"] == (K, K) and reference["clocks"] == (2 * K, 2 * K)
    for _, (restored, continued) in outcome_values(checkpointed.restarted, [0, 1]):
        assert_bitwise_equal(restored["dense"], values["dense"], "dense values after the restart")
        assert_bitwise_equal(restored["rows"], values["rows"], "sparse rows after the restart")
        assert restored["clocks"] == (K, K)
        assert not torch.equal(continued["dense"], restored["dense"])  # the K more steps did train
        assert continued["clocks"] == (2 * K, 2 * K)
        assert_bitwise_equal(continued["dense"], reference["dense"], "dense values: restarted vs uninterrupted")
        assert_bitwise_equal(continued["rows"], reference["rows"], "sparse rows: restarted vs uninterrupted")


# --- A periodic checkpoint under BSP, then the server dies: every worker hears of it; a restart resumes. ---

PERIODIC_EVERY = 2
PERIODIC_STEPS = 5  # the last periodic checkpoint is at clock 4
SERVER_DEATH_TIMEOUT_S = 20


def one_server(consistency, directory=None, timeout=TIMEOUT_S, **options):
    return ps.ParameterService(servers=1, consistency=consistency, checkpoint_dir=directory, timeout=timeout,
                               stats_interval=3600, **options)


def periodic_then_server_death(rank, world, directory, flags):
    flags = pathlib.Path(flags)
    service = one_server("bsp", directory, SERVER_DEATH_TIMEOUT_S, checkpoint_every=PERIODIC_EVERY)
    if service.is_server:
        kill_self_when(flags / "kill-server", dying=flags / "server-dying")
        return service.serve()  # does not return: killed
    client, worker = service.client, service.worker_index
    w, e = register_tables(client)
    history = []  # history[s]: the tables at clock s + 1
    for step in range(PERIODIC_STEPS):
        train(client, w, e, [step], worker)
        history.append(state(client, w, e))
    touch(flags / f"worker-{worker}-trained")
    grad, _, _ = gradients(PERIODIC_STEPS, worker)
    if worker == 0:
        # In flight when the server dies: BSP holds it for worker 1's push, which never comes.
        pending = client.push_pull([w], [grad])
        wait_for(flags / "worker-1-trained")  # its last pulls are answered before the server dies
        start = time.monotonic()
        touch(flags / "kill-server")
        message = error_of(pending.wait)
    else:
        wait_for(flags / "server-dying")
        time.sleep(0.5)
        start = time.monotonic()
        message = error_of(lambda: client.push_pull([w], [grad]))
    seconds = time.monotonic() - start
    later = error_of(lambda: client.pull([w]))
    service.finish()
    return history, message, seconds, later


def resume_from_periodic(rank, world, directory):
    service = one_server("bsp", directory, checkpoint_every=PERIODIC_EVERY)
    if service.is_server:
        return service.serve()
    client, worker = service.client, service.worker_index
    w, e = register_tables(client)
    restored = state(client, w, e)
    train(client, w, e, [restored["clocks"][0]], worker)
    resumed = state(client, w, e)
    service.finish()
    return restored, resumed


def test_a_dead_server_fails_every_worker_within_the_timeout_and_a_restart_resumes_from_the_periodic_checkpoint(
        tmp_path):
    directory, flags = tmp_path / "checkpoints", tmp_path / "flags"
    flags.mkdir()
    outcomes = launch_ranks(3, periodic_then_server_death, str(directory), str(flags), deadline_s=DEADLINE_S,
                            collective_timeout_s=TIMEOUT_S, grace_s=DEADLINE_S)
    assert_killed(outcomes[2])
    histories = []
    for history, message, seconds, later in outcome_values(outcomes, [0, 1]):
        assert "parameter server 0 (rank 2)" in message, message
        assert seconds < SERVER_DEATH_TIMEOUT_S, f"the error took {seconds:.1f} s"
        assert "parameter server 0 (rank 2)" in later, later
        histories.append(history)
    assert_bitwise_equal(histories[1][-1]["dense"], histories[0][-1]["dense"], "the two workers' pulls")

    # The server wrote every PERIODIC_EVERY clocks and died before writing at its end.
    assert listing(directory) == ["server-0-of-1.pt"]
    saved = load_checkpoint(directory / "server-0-of-1.pt")
    assert [(t["name"], list(t["pushes"]), t["applied"]) for t in saved["tables"]] == [("w", [4, 4], 4),
                                                                                       ("e", [4, 4], 4)]
    outcomes = launch_ranks(3, resume_from_periodic, str(directory), deadline_s=DEADLINE_S,
                            collective_timeout_s=TIMEOUT_S)
    history = histories[0]
    for restored, resumed in outcome_values(outcomes, [0, 1]):
        assert restored["clocks"] == (4, 4)
        assert_bitwise_equal(restored["dense"], history[3]["dense"], "dense values restored at clock 4")
        assert_bitwise_equal(restored["rows"], history[3]["rows"], "sparse rows restored at clock 4")
        assert resumed["clocks"] == (5, 5)
        assert_bitwise_equal(resumed["dense"], history[4]["dense"], "dense values one step after the restart")
        assert_bitwise_equal(resumed["rows"], history[4]["rows"], "sparse rows one step after the restart")


# --- A worker killed mid-training, under each consistency model: the others train on. ---

LOSS_STEPS = 6
DIES_AT_STEP = 2  # worker 2 pushed steps 0 and 1


def lose_a_worker(rank, world, consistency, flags):
    flags = pathlib.Path(flags)
    service = one_server(consistency, staleness=1)
    if service.is_server:
        log = PsLog()
        return service.serve(), log.warnings()
    client, worker = service.client, service.worker_index
    w = client.dense_table("w", torch.zeros(4), ps.SGD(lr=1.0))
    for step in range(LOSS_STEPS):
        if step == DIES_AT_STEP:
            if worker == 2:
                touch(flags / "dying")
                kill_self()
            wait_for(flags / "dying")  # the others have steps left when it dies, whatever the model
        client.push_pull([w], [torch.full((4,), worker + 1.0)]).wait()
    touch(flags / f"done-{worker}")
    wait_for(flags / f"done-{1 - worker}")
    final = client.pull([w]).wait()[0]
    clock = client.clock(w)
    service.finish()
    return final, clock


@pytest.mark.parametrize("consistency", ["bsp", "asp", "ssp"])
def test_a_killed_worker_is_dropped_and_the_others_finish(tmp_path, consistency):
    outcomes = launch_ranks(4, lose_a_worker, consistency, str(tmp_path), deadline_s=DEADLINE_S,
                            collective_timeout_s=TIMEOUT_S, grace_s=DEADLINE_S)
    assert_killed(outcomes[2])
    (final0, clock0), (final1, clock1), (stats, warnings) = outcome_values(outcomes, [0, 1, 3])
    assert clock0 == clock1 == LOSS_STEPS
    assert stats["lost_workers"] == [2]
    # BSP holds round 2, SSP (staleness 1) holds clock 3 for worker 2 until it is dropped: both wait for it.
    lost = [line for line in warnings if "worker 2 (rank 2) lost: its connection broke" in line]
    assert len(lost) == 1, warnings
    assert consistency == "asp" or lost[0].endswith("continuing with 2 workers"), lost
    if consistency == "bsp":
        # Rounds 0-1: the mean of 1, 2, 3; rounds 2-5: the mean of the remaining workers' 1 and 2.
        expected = -(DIES_AT_STEP * 2.0 + (LOSS_STEPS - DIES_AT_STEP) * 1.5)
    else:
        # Every push applied as it came: all of workers 0 and 1, and worker 2's two.
        expected = -(LOSS_STEPS * (1.0 + 2.0) + DIES_AT_STEP * 3.0)
    assert torch.equal(final0, torch.full((4,), expected)), final0
    assert torch.equal(final1, final0)


# --- BSP: a worker that stays alive but stops pushing is dropped after the timeout. ---

DROP_TIMEOUT_S = 4.0


def stop_pushing(rank, world, flags):
    flags = pathlib.Path(flags)
    service = one_server("bsp", timeout=DROP_TIMEOUT_S)
    if service.is_server:
        log = PsLog()
        return service.serve(), log.warnings()
    client, worker = service.client, service.worker_index
    w = client.dense_table("w", torch.zeros(4), ps.SGD(lr=1.0))
    for _ in range(2):
        client.push_pull([w], [torch.full((4,), worker + 1.0)]).wait()
    if worker == 1:
        time.sleep(DROP_TIMEOUT_S + 3)  # alive, but silent past the timeout
        message = error_of(lambda: client.push_pull([w], [torch.full((4,), 2.0)]))
        touch(flags / "refused")
        service.finish()
        return message
    seconds = []
    for _ in range(3):
        start = time.monotonic()
        client.push([w], [torch.ones(4)]).wait()
        # The pull goes out a moment after the push: a request's deadline is the same timeout as the round's,
        # so a push_pull sent as the round opens would race worker 1's drop (and may time out first).
        time.sleep(1.0)
        client.pull([w]).wait()
        seconds.append(time.monotonic() - start)
    wait_for(flags / "refused")  # keeps the server serving until worker 1 tried again
    final = client.pull([w]).wait()[0]
    service.finish()
    return final, seconds


def test_bsp_drops_a_silent_worker_after_the_timeout_and_refuses_its_later_requests(tmp_path):
    outcomes = launch_ranks(3, stop_pushing, str(tmp_path), deadline_s=DEADLINE_S, collective_timeout_s=TIMEOUT_S)
    (final, seconds), message, (stats, warnings) = outcome_values(outcomes, [0, 1, 2])
    assert "worker 1 (rank 1) was dropped by server 0" in message, message
    assert stats["lost_workers"] == [1]
    assert any("worker 1 (rank 1) lost: it did not push clock 2 of table 'w' within the timeout" in line
               for line in warnings), warnings
    # Round 2 waited the timeout for worker 1, then went on without it; rounds 3-4 did not wait.
    assert DROP_TIMEOUT_S - 0.5 < seconds[0] < DROP_TIMEOUT_S + 10, seconds
    assert max(seconds[1:]) < DROP_TIMEOUT_S - 0.5, seconds
    # Rounds 0-1: the mean of 1 and 2; rounds 2-4: worker 0's 1 alone.
    assert torch.equal(final, torch.full((4,), -(2 * 1.5 + 3 * 1.0))), final


# --- Bad input: refused with the reason; the sender's next requests are served, nothing was applied. ---

BAD_ROWS, BAD_DIM = 10, 3
W, E, M = 0, 1, 2  # the tables' ids on the server, in order of creation
F32, F64 = DTYPE_CODE[torch.float32], DTYPE_CODE[torch.float64]
GARBAGE_KINDS = [Kind.REGISTER_DENSE, Kind.REGISTER_SPARSE, Kind.PULL, Kind.PUSH, Kind.PUSH_PULL, Kind.PULL_ROWS,
                 Kind.PUSH_ROWS, Kind.SET_LEARNING_RATE, Kind.CHECKPOINT]

# label: text (or texts) every refusal's message contains
EXPECTED_REFUSALS = {
    "unknown table (raw pull)": "unknown table id 99 (server 0 holds 3 tables)",
    "unknown table (raw push_rows)": "unknown table id 99",
    "wrong element count (raw push)": "server 0 holds elements [0, 6)): 5 elements, expected 6",
    "wrong shape (client push)": ("push to table 'w' (shape ", "a gradient of shape [5]"),
    "transposed gradient (client push)": "push to table 'm' (shape [2, 3]): a gradient of shape [3, 2]; gradients "
                                         "must have the table's shape",
    "transposed gradient (raw push)": "push to table 'm': a gradient of shape [3, 2] for a table of shape [2, 3]",
    "read of another shape (raw pull)": "pull from table 'm': a read of shape [6] for a table of shape [2, 3]",
    "wrong dtype (client push)": "gradient dtype Double, the table holds Float",
    "wrong dtype (raw push)": "push to table 'w': dtype Double, the table holds Float",
    "unknown dtype code (raw push)": "unknown dtype code 3 (1: float32, 2: float64)",
    "row id out of range (client pull_rows)": "row id 10 is out of range [0, 10)",
    "row id out of range (raw pull_rows)": "pull from table 'e': row id 10 is out of range [0, 10)",
    "negative row id (raw push_rows)": "push to table 'e': row id -1 is out of range [0, 10)",
    "wrong row width (raw push_rows)": "rows of 2 values, the table's rows have 3",
    "pull of a sparse table (raw pull)": "pull from table 'e': it is sparse",
    "truncated (every prefix of a valid raw push)": "truncated message",
    "bytes left over (raw push)": "8 bytes left over after the last field",
    "garbage bytes": "torchpar.ps server 0 refused",
    "unknown message kind": "unknown request kind",
    "malformed finish": "left over",
    "dense table re-registered with another shape": ("table 'w' registered as Float", "(shard [0, 7)), but it is Float",
                                                     "(shard [0, 6))"),
    "dense table re-registered with another optimizer": "registered with optimizer Adam",
    "sparse table re-registered with another width": "sparse table 'e' registered with 10 rows of 4",
    "sparse registration of a dense table's name": "table 'w' is already registered as a dense table",
    "stale clock (raw push at clock 0)": "push to table 'w' at clock 0: worker 0 (rank 0) has pushed",
    "future clock (raw push)": "worker 0 (rank 0) has pushed",
    "one bad item refuses the whole request": "unknown table id 99",
    "table listed twice": "table 'w' listed twice in one request",
    "negative learning rate": "learning rate -1 is negative",
    "checkpoint without a directory": "no checkpoint directory was given to the parameter service",
}


def refusals(client, w, e, m):
    """Worker 0's bad requests, each followed by correct ones; returns label -> the refusals' messages."""
    expected = {"w": torch.zeros(6), "e": torch.zeros(BAD_ROWS, BAD_DIM)}
    messages = {}

    def refused(label, *calls):
        messages[label] = [error_of(call) for call in calls]
        # The same worker's next requests are served, and nothing of the refused ones was applied.
        row = len(messages) % BAD_ROWS
        client.push([w], [torch.ones(6)]).wait()
        client.push_rows([e], [torch.tensor([row])], [torch.ones(1, BAD_DIM)]).wait()
        expected["w"] -= 1
        expected["e"][row] -= 1
        assert torch.equal(client.pull([w]).wait()[0], expected["w"]), label
        assert torch.equal(client.pull_rows([e], [torch.arange(BAD_ROWS)]).wait()[0], expected["e"]), label

    def raw(kind, payload):
        return lambda: client.send_raw(0, kind, payload.to_tensor() if hasattr(payload, "to_tensor") else payload)

    def valid_push():  # what client.push([w], [ones]) would send now
        return dense_payload([(W, client.clock(w), F32, 6, torch.ones(6))])

    ones = torch.ones(6)
    refused("unknown table (raw pull)", raw(Kind.PULL, dense_payload([(99, 0, F32, 6, None)])))
    refused("unknown table (raw push_rows)",
            raw(Kind.PUSH_ROWS, rows_payload([(99, client.clock(e), F32, [1], BAD_DIM, torch.ones(1, BAD_DIM))])))
    refused("wrong element count (raw push)",
            raw(Kind.PUSH, dense_payload([(W, client.clock(w), F32, 5, torch.ones(5), [6])])))
    refused("wrong shape (client push)", lambda: client.push([w], [torch.ones(5)]))
    # Same element count, other shape: applied by flat index it would land on the wrong elements.
    refused("transposed gradient (client push)", lambda: client.push([m], [torch.ones(3, 2)]))
    refused("transposed gradient (raw push)",
            raw(Kind.PUSH, dense_payload([(M, client.clock(m), F32, 6, torch.ones(6), [3, 2])])))
    refused("read of another shape (raw pull)", raw(Kind.PULL, dense_payload([(M, 0, F32, 6, None)])))
    assert torch.equal(client.pull([m]).wait()[0], torch.zeros(2, 3))
    refused("wrong dtype (client push)", lambda: client.push([w], [ones.double()]))
    refused("wrong dtype (raw push)", raw(Kind.PUSH, dense_payload([(W, client.clock(w), F64, 6, ones.double())])))
    refused("unknown dtype code (raw push)", raw(Kind.PUSH, dense_payload([(W, client.clock(w), 3, 6, ones)])))
    refused("row id out of range (client pull_rows)", lambda: client.pull_rows([e], [torch.tensor([2, BAD_ROWS])]))
    refused("row id out of range (raw pull_rows)",
            raw(Kind.PULL_ROWS, rows_payload([(E, client.clock(e), F32, [2, BAD_ROWS], BAD_DIM, None)])))
    refused("negative row id (raw push_rows)",
            raw(Kind.PUSH_ROWS, rows_payload([(E, client.clock(e), F32, [-1], BAD_DIM, torch.ones(1, BAD_DIM))])))
    refused("wrong row width (raw push_rows)",
            raw(Kind.PUSH_ROWS, rows_payload([(E, client.clock(e), F32, [1], 2, torch.ones(1, 2))])))
    refused("pull of a sparse table (raw pull)", raw(Kind.PULL, dense_payload([(E, 0, F32, BAD_DIM, None)])))
    whole = valid_push().to_tensor()
    refused("truncated (every prefix of a valid raw push)", *[raw(Kind.PUSH, whole[:n]) for n in range(len(whole))])
    refused("bytes left over (raw push)", raw(Kind.PUSH, torch.cat([whole, torch.zeros(8, dtype=torch.uint8)])))
    generator = random.Random(0)
    refused("garbage bytes", *[raw(kind, torch.tensor(list(generator.randbytes(generator.randint(1, 200))),
                                                     dtype=torch.uint8))
                               for kind in GARBAGE_KINDS for _ in range(4)])
    refused("unknown message kind", *[raw(kind, valid_push()) for kind in (77, 0, -3, 100, 101, 102)])
    # A finish with a payload is malformed: refused, and the worker's later requests are still read.
    refused("malformed finish", raw(Kind.FINISH, torch.tensor([1, 2, 3], dtype=torch.uint8)))
    refused("dense table re-registered with another shape",
            lambda: client.dense_table("w", torch.zeros(7), ps.SGD(lr=1.0)))
    refused("dense table re-registered with another optimizer",
            lambda: client.dense_table("w", torch.zeros(6), ps.Adam(lr=1.0)))
    refused("sparse table re-registered with another width",
            lambda: client.sparse_table("e", BAD_ROWS, BAD_DIM + 1, ps.SGD(lr=1.0)))
    refused("sparse registration of a dense table's name",
            lambda: client.sparse_table("w", BAD_ROWS, BAD_DIM, ps.SGD(lr=1.0)))
    assert client.clock(w) > 0
    refused("stale clock (raw push at clock 0)", raw(Kind.PUSH, dense_payload([(W, 0, F32, 6, ones)])))
    refused("future clock (raw push)", raw(Kind.PUSH, dense_payload([(W, client.clock(w) + 1, F32, 6, ones)])))
    refused("one bad item refuses the whole request",
            raw(Kind.PUSH, dense_payload([(W, client.clock(w), F32, 6, ones), (99, 0, F32, 6, ones)])))
    refused("table listed twice",
            raw(Kind.PUSH, dense_payload([(W, client.clock(w), F32, 6, ones), (W, client.clock(w), F32, 6, ones)])))
    refused("negative learning rate", lambda: client.set_learning_rate(w, -1.0))
    refused("checkpoint without a directory", client.checkpoint)
    return messages


def bad_input(rank, world, flags):
    flags = pathlib.Path(flags)
    # Launch errors first: each refused before the service creates anything, so the rank can go on.
    launch_errors = {}
    for value in ("0", "abc", str(world)):
        os.environ["TORCHPAR_PS_SERVERS"] = value
        launch_errors[value] = error_of(lambda: ps.ParameterService(timeout=TIMEOUT_S))
    del os.environ["TORCHPAR_PS_SERVERS"]
    launch_errors["servers=world"] = error_of(lambda: ps.ParameterService(servers=world, timeout=TIMEOUT_S))
    os.environ["TORCHPAR_PS_SERVERS"] = "1"
    service = ps.ParameterService(consistency="asp", timeout=TIMEOUT_S, stats_interval=3600)
    del os.environ["TORCHPAR_PS_SERVERS"]
    launch = (launch_errors, service.num_servers)
    if service.is_server:
        return launch, service.serve()
    client = service.client
    w = client.dense_table("w", torch.zeros(6), ps.SGD(lr=1.0))
    e = client.sparse_table("e", BAD_ROWS, BAD_DIM, ps.SGD(lr=1.0))
    m = client.dense_table("m", torch.zeros(2, 3), ps.SGD(lr=1.0))
    if service.worker_index == 0:
        result = refusals(client, w, e, m)
        touch(flags / "done")
    else:  # meanwhile, the other worker keeps being served
        result = 0
        while not (flags / "done").exists():
            client.pull([w]).wait()
            client.pull_rows([e], [torch.tensor([0, BAD_ROWS - 1])]).wait()
            result += 1
            time.sleep(0.02)
    service.finish()
    return launch, result


@pytest.fixture(scope="module")
def bad_input_job(tmp_path_factory):
    return launch_ranks(3, bad_input, str(tmp_path_factory.mktemp("bad-input")), deadline_s=DEADLINE_S,
                        collective_timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("label", list(EXPECTED_REFUSALS))
def test_bad_input_is_refused_with_the_reason_and_the_server_keeps_serving(bad_input_job, label):
    (_, messages), (_, served), (_, stats) = outcome_values(bad_input_job, [0, 1, 2])
    assert sorted(messages) == sorted(EXPECTED_REFUSALS)
    expected = EXPECTED_REFUSALS[label]
    for message in messages[label]:
        for text in (expected,) if isinstance(expected, str) else expected:
            assert text in message, message
    assert served > 0  # worker 1's pulls were answered all along
    assert stats["lost_workers"] == []  # nobody was dropped for a bad request


def test_unusable_torchpar_ps_servers_is_refused_naming_the_variable(bad_input_job):
    for (launch_errors, num_servers), _ in outcome_values(bad_input_job, [0, 1, 2]):
        for value in ("0", "abc"):
            assert f"TORCHPAR_PS_SERVERS='{value}' is not a positive number of server ranks" in launch_errors[value]
        assert "TORCHPAR_PS_SERVERS=3 leaves 0 worker ranks in a job of 3" in launch_errors["3"], launch_errors
        assert "num_servers=3 leaves 0 worker ranks in a job of 3" in launch_errors["servers=world"], launch_errors
        assert num_servers == 1  # a usable value is taken
