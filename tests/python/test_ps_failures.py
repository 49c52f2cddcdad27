"""The parameter service under failures: checkpoints survive kill -9 and restore exactly, lost workers and
servers are handled, and malformed requests cost their sender an error, nothing more.

Ranks die for real (kill -9 of their own process) under launch_ranks, which reports the dead rank and lets
the others finish. Gradients are fixed functions of (step, worker) so that runs can be compared bit for bit
(BSP: each round applies the workers' mean in worker order) or checked against exact arithmetic.
"""
import pathlib
import random
import time

import pytest
import torch

from ps_helpers import (DTYPE_CODE, Kind, PsLog, checkpoint_files, dense_payload, error_of, kill_self,
                        kill_self_when, load_checkpoint, rows_payload, touch, wait_for)
from rank_harness import launch_ranks

import torchpar.ps as ps

# --- Training shared by the checkpoint tests: an Adam dense table and an Adagrad sparse table. ---

SHAPE = (5, 3)  # 15 elements: 7 + 8 over two servers
NUM_ROWS, DIM = 40, 4
K = 3  # steps before the checkpoint, and after the restart
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
    """The tables' values as a worker pulls them, and its clocks."""
    dense = client.pull([w]).wait()[0]
    rows = client.pull_rows([e], [ALL_ROWS]).wait()[0]
    return dict(dense=dense, rows=rows, clocks=(client.clock(w), client.clock(e)))


def service_of(directory=None, **options):
    options.setdefault("timeout", 60)
    options.setdefault("stats_interval", 3600)
    return ps.ParameterService(servers=2, checkpoint_dir=directory, **options)


def train_then_die(rank, world, directory, consistency, victim):
    """Job 1: K steps, a checkpoint, the values as pulled; then rank ``victim`` dies (kill -9)."""
    flags = pathlib.Path(directory)
    service = service_of(directory, consistency=consistency, staleness=1)
    if service.is_server:
        if rank == victim:
            kill_self_when(flags / "kill-server", dying=flags / "server-dying")
        return service.serve()
    client = service.client
    w, e = register_tables(client)
    train(client, w, e, range(K), service.worker_index)
    client.checkpoint()
    # checkpoint() returned: every server's file is on disk, whole.
    files = [load_checkpoint(path) for path in checkpoint_files(directory, 2)]
    values = state(client, w, e)
    if rank == victim:
        kill_self()
    if victim >= service.num_workers:  # a server dies: wait until it did, so it cannot write at the end
        if service.worker_index == 0:
            touch(flags / "kill-server")
        wait_for(flags / "server-dying")
        time.sleep(0.5)
    service.finish()
    return values, files


def uninterrupted(rank, world):
    """The reference: 2K steps without a stop (BSP, no checkpoint)."""
    service = service_of(consistency="bsp")
    if service.is_server:
        return service.serve()
    client = service.client
    w, e = register_tables(client)
    train(client, w, e, range(2 * K), service.worker_index)
    values = state(client, w, e)
    service.finish()
    return values


def restart(rank, world, directory, consistency, continue_training):
    """Job 2: the same tables over the same checkpoint directory; optionally K more steps."""
    service = service_of(directory, consistency=consistency, staleness=1)
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


def passed(outcomes, ranks):
    for rank in ranks:
        assert outcomes[rank].passed, outcomes[rank].message
    return [outcomes[rank].value for rank in ranks]


def assert_bitwise_equal(got, expected, what):
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    assert torch.equal(got, expected), f"{what}: max difference {(got - expected).abs().max().item()}"


def assert_checkpoint_matches(files, values, clock):
    """Both servers' files hold the pulled values (dense: contiguous shards; sparse: rows by id), clock K."""
    dense = torch.cat([next(t for t in f["tables"] if t["name"] == "w")["values"] for f in files])
    assert_bitwise_equal(dense, values["dense"].view(-1), "the dense table in the checkpoint files")
    for f in files:
        assert f["format"] == "torchpar.ps" and f["servers"] == 2 and f["workers"] == 2
        sparse = next(t for t in f["tables"] if t["name"] == "e")
        assert_bitwise_equal(sparse["values"], values["rows"][sparse["ids"]], "the sparse rows in the checkpoint")
        for table in f["tables"]:
            assert list(table["pushes"]) == [clock, clock], table["name"]


def assert_no_temporary_files(directory):
    names = sorted(p.name for p in pathlib.Path(directory).iterdir() if not p.name.endswith(("dying", "server")))
    assert [n for n in names if n.endswith(".tmp")] == [], names
    return names


def test_checkpoint_survives_a_killed_worker_and_restores_exactly_under_ssp(tmp_path):
    # Job 1: SSP, worker 1 dies (kill -9) right after the checkpoint.
    outcomes = launch_ranks(4, train_then_die, str(tmp_path), "ssp", 1, deadline_s=120, collective_timeout_s=60,
                            grace_s=60)
    assert "killed by signal 9" in outcomes[1].message, outcomes[1].message
    (values, files), stats0, stats1 = passed(outcomes, [0, 2, 3])
    assert values["clocks"] == (K, K)
    assert_checkpoint_matches(files, values, K)
    assert stats0["lost_workers"] == [1] and stats1["lost_workers"] == [1]
    assert assert_no_temporary_files(tmp_path) == ["server-0-of-2.pt", "server-1-of-2.pt"]

    # Job 2: the same checkpoint directory, same servers and workers.
    outcomes = launch_ranks(4, restart, str(tmp_path), "ssp", False, deadline_s=120, collective_timeout_s=60)
    for restored, _ in passed(outcomes, [0, 1]):
        assert_bitwise_equal(restored["dense"], values["dense"], "dense values after the restart")
        assert_bitwise_equal(restored["rows"], values["rows"], "sparse rows after the restart")
        assert restored["clocks"] == (K, K)


def test_checkpoint_survives_a_killed_server_and_training_resumes_as_if_uninterrupted_under_bsp(tmp_path):
    # Job 1: BSP, K steps, checkpoint; then server 1 (rank 3) dies (kill -9), so only the checkpoint
    # requested by the workers is on disk for it.
    outcomes = launch_ranks(4, train_then_die, str(tmp_path), "bsp", 3, deadline_s=120, collective_timeout_s=60,
                            grace_s=60)
    assert "killed by signal 9" in outcomes[3].message, outcomes[3].message
    (values, files), (values1, _), _ = passed(outcomes, [0, 1, 2])
    assert_bitwise_equal(values1["dense"], values["dense"], "the workers' pulls")
    assert values["clocks"] == (K, K)
    assert_checkpoint_matches(files, values, K)
    assert_no_temporary_files(tmp_path)

    # Job 2 restores the checkpoint and trains K more steps; a job that never stopped trained 2K steps.
    outcomes = launch_ranks(4, restart, str(tmp_path), "bsp", True, deadline_s=120, collective_timeout_s=60)
    (restored, continued), (_, continued1) = passed(outcomes, [0, 1])
    assert_bitwise_equal(restored["dense"], values["dense"], "dense values after the restart")
    assert_bitwise_equal(restored["rows"], values["rows"], "sparse rows after the restart")
    assert restored["clocks"] == (K, K)
    reference = passed(launch_ranks(4, uninterrupted, deadline_s=120, collective_timeout_s=60), [0])[0]
    assert reference["clocks"] == continued["clocks"] == (2 * K, 2 * K)
    assert not torch.equal(reference["dense"], restored["dense"])  # the last K steps did change the values
    for got in (continued, continued1):
        assert_bitwise_equal(got["dense"], reference["dense"], "dense values: restarted vs uninterrupted")
        assert_bitwise_equal(got["rows"], reference["rows"], "sparse rows: restarted vs uninterrupted")
