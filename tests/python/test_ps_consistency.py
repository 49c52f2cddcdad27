"""The parameter service's consistency models, checked against what each promises.

BSP: W workers on shards of a global batch train exactly as one process on the whole batch (the server
applies the mean of the workers' gradients), for dense parameters (RemoteParameters; plain SGD and
SGD with momentum and weight decay) and for embeddings (ps.Embedding, duplicate ids, SGD and Adagrad).
ASP: concurrent pushes from every worker all land, none lost, over 1, 2 and 3 servers.
SSP: a read at clock c sees every worker's pushes of clocks < c - s, the fast worker waits for the slow
one, yet runs up to s clocks ahead; ASP in the same setup runs further ahead (so the check can fail).
Under each model a wide table's reads are lent in place by the servers (not copied into the replies), and
each read sees one state of each shard.
"""
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ps_helpers import run_scenarios

import torchpar.ps as ps

# --- BSP equals single-process training on the global batch ------------------------------------------

IN, HIDDEN, OUT = 4, 6, 2
SHARD = 3  # samples per worker and step
STEPS = 4
LR = 0.1
MOMENTUM = dict(momentum=0.9, weight_decay=0.01)
NUM_ROWS, DIM, BAG = 40, 3, 4
ADAGRAD_LR = 0.2
ROW_INIT = dict(low=-0.5, high=0.5, seed=11)
# Past the size from which a server lends a shard's values to same-host readers instead of copying them
# (csrc/torchpar/ps/server.cpp, kSharedValuesFromBytes), with 1, 2 or 3 servers.
WIDE = 200_000


def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def head(seed):
    torch.manual_seed(seed)
    return nn.Linear(DIM, 1)


def global_batch(step, workers):
    """Dense inputs and targets, and for the embedding model two bags of ids per sample: ids from a small
    range so that rows repeat within a sample, a worker's shard and across workers."""
    generator = torch.Generator().manual_seed(100 + step)
    n = workers * SHARD
    x, y = torch.randn(n, IN, generator=generator), torch.randn(n, OUT, generator=generator)
    ids = torch.randint(0, 10, (n, BAG), generator=generator)
    ids2 = torch.randint(0, NUM_ROWS, (n, BAG), generator=generator)
    target = torch.randn(n, 1, generator=generator)
    return x, y, ids, ids2, target


def sparse_forward(embedding, embedding2, linear, ids, ids2):
    return linear(embedding(ids).sum(1) + embedding2(ids2).mean(1))


def wide_gradient(step, worker):
    return torch.randn(WIDE, generator=torch.Generator().manual_seed(1000 * step + worker))


def bsp_worker(service, workers):
    client, w = service.client, service.worker_index
    # Only worker 0's values start the tables: the others' modules start elsewhere and are overwritten.
    plain = mlp(0 if w == 0 else 50 + w)
    momentum = mlp(1 if w == 0 else 60 + w)
    linear = head(2 if w == 0 else 70 + w)
    plain_params = ps.RemoteParameters(plain, client, ps.SGD(LR), prefix="plain.")
    momentum_params = ps.RemoteParameters(momentum, client, ps.SGD(LR, **MOMENTUM), prefix="momentum.")
    head_params = ps.RemoteParameters(linear, client, ps.SGD(LR), prefix="head.")
    embedding = ps.Embedding(client, "emb.sgd", NUM_ROWS, DIM, ps.SGD(LR), ps.uniform(**ROW_INIT))
    embedding2 = ps.Embedding(client, "emb.adagrad", NUM_ROWS, DIM, ps.Adagrad(ADAGRAD_LR), ps.uniform(**ROW_INIT))
    shard = slice(w * SHARD, (w + 1) * SHARD)
    losses = {"plain": [], "momentum": [], "sparse": []}
    for step in range(STEPS):
        x, y, ids, ids2, target = (t[shard] for t in global_batch(step, workers))
        for name, model, params in [("plain", plain, plain_params), ("momentum", momentum, momentum_params)]:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            # Backward itself pushed every bucket (the overlap); step() only waits for the values.
            assert params.clock == step + 1, (name, params.clock, step)
            params.step()
            losses[name].append(loss.item())
        loss = nn.functional.mse_loss(sparse_forward(embedding, embedding2, linear, ids, ids2), target)
        loss.backward()
        head_params.step()
        losses["sparse"].append(loss.item())
    embedding.flush()
    embedding2.flush()
    # A table whose shards the servers lend in place: each read at clock t+1 is the state after round t.
    wide = client.dense_table("wide", torch.linspace(-1, 1, WIDE), ps.SGD(LR))
    wide_reads = [client.push_pull([wide], [wide_gradient(step, w)]).wait()[0] for step in range(STEPS)]
    rows = client.pull_rows([embedding.table, embedding2.table], [torch.arange(NUM_ROWS)] * 2).wait()
    return dict(
        losses=losses,
        plain={k: v.detach().clone() for k, v in plain.state_dict().items()},
        momentum={k: v.detach().clone() for k, v in momentum.state_dict().items()},
        head={k: v.detach().clone() for k, v in linear.state_dict().items()},
        rows=rows,
        clock=plain_params.clock,
        wide_reads=wide_reads,
    )


def bsp_reference(workers):
    """One process, the whole global batch, torch.optim."""
    plain, momentum, linear = mlp(0), mlp(1), head(2)
    initial = ps.initial_rows(ps.uniform(**ROW_INIT), torch.arange(NUM_ROWS), DIM).float()
    embedding = nn.Embedding.from_pretrained(initial.clone(), freeze=False)
    embedding2 = nn.Embedding.from_pretrained(initial.clone(), freeze=False)
    optimizers = [
        torch.optim.SGD(plain.parameters(), lr=LR),
        torch.optim.SGD(momentum.parameters(), lr=LR, **MOMENTUM),
        torch.optim.SGD([*linear.parameters(), embedding.weight], lr=LR),
        torch.optim.Adagrad([embedding2.weight], lr=ADAGRAD_LR),
    ]
    losses = {"plain": [], "momentum": [], "sparse": []}
    for step in range(STEPS):
        x, y, ids, ids2, target = global_batch(step, workers)
        for optimizer in optimizers:
            optimizer.zero_grad()
        for name, model in [("plain", plain), ("momentum", momentum)]:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses[name].append(loss.item())
        loss = nn.functional.mse_loss(sparse_forward(embedding, embedding2, linear, ids, ids2), target)
        loss.backward()
        losses["sparse"].append(loss.item())
        for optimizer in optimizers:
            optimizer.step()
    wide, wide_reads = torch.linspace(-1, 1, WIDE), []
    for step in range(STEPS):
        wide = wide - LR * sum(wide_gradient(step, w) for w in range(workers)) / workers
        wide_reads.append(wide)
    return dict(losses=losses, plain=plain.state_dict(), momentum=momentum.state_dict(), head=linear.state_dict(),
                rows=[embedding.weight.detach(), embedding2.weight.detach()], initial_rows=initial,
                wide_reads=wide_reads)


@pytest.mark.parametrize("workers,servers", [(2, 2), (3, 1)])
def test_bsp_equals_single_process_training_on_the_global_batch(scenario, workers, servers):
    results, stats = scenario(workers, servers, "bsp")
    expected = bsp_reference(workers)
    for w, result in enumerate(results):
        assert result["clock"] == STEPS
        for model in ["plain", "momentum", "head"]:
            for name, value in expected[model].items():
                torch.testing.assert_close(result[model][name], value, atol=1e-5, rtol=0,
                                           msg=lambda m: f"worker {w}, {model}.{name}: {m}")
        for table, got, value in zip(["emb.sgd", "emb.adagrad"], result["rows"], expected["rows"]):
            torch.testing.assert_close(got, value, atol=1e-5, rtol=0, msg=lambda m: f"worker {w}, {table}: {m}")
        for step, (got, value) in enumerate(zip(result["wide_reads"], expected["wide_reads"])):
            torch.testing.assert_close(got, value, atol=1e-5, rtol=0, msg=lambda m: f"worker {w}, wide, {step}: {m}")
    for model, reference in expected["losses"].items():
        # Each worker's loss is its shard's mean; equal shards: their mean is the global batch's loss.
        mean = [sum(r["losses"][model][step] for r in results) / workers for step in range(STEPS)]
        assert mean == pytest.approx(reference, abs=1e-5), model
    # Not vacuous: training moved every part, the embeddings' rows included.
    assert not torch.allclose(expected["plain"]["0.weight"], mlp(0).state_dict()["0.weight"], atol=1e-3)
    assert not torch.allclose(expected["momentum"]["2.weight"], mlp(1).state_dict()["2.weight"], atol=1e-3)
    for rows in expected["rows"]:
        assert not torch.allclose(rows, expected["initial_rows"], atol=1e-3)
    assert all(s["max_staleness"] == 0 and s["lost_workers"] == [] for s in stats)
    assert all(s["reads_in_place"] >= workers * STEPS for s in stats), stats  # the wide table's reads


# --- ASP: every push lands ----------------------------------------------------------------------------

ASP_PUSHES = 40
ASP_ROWS, ASP_DIM = 16, 2
DENSE_INITIAL = torch.arange(5.0) * 10


def asp_pushes(worker):
    """Integer-valued gradients: any order of application sums exactly."""
    generator = torch.Generator().manual_seed(worker)
    pushes = []
    for _ in range(ASP_PUSHES):
        dense = torch.randint(-3, 4, (5,), generator=generator).float()
        small = torch.randint(-3, 4, (2,), generator=generator).float()
        ids = torch.randint(0, 12, (5,), generator=generator)  # duplicates; rows 12..15 never pushed
        rows = torch.randint(-3, 4, (5, ASP_DIM), generator=generator).float()
        wide = int(torch.randint(1, 4, (), generator=generator))  # every element of the wide table's gradient
        pushes.append((dense, small, ids, rows, wide))
    return pushes


def shard_ranges(numel, servers):
    """The flattened ranges of a dense table the servers hold (csrc/torchpar/ps/client.cpp)."""
    return [(numel * s // servers, numel * (s + 1) // servers) for s in range(servers)]


def torn_shards(values, servers):
    """Shards of a read of the wide table whose elements differ: every push adds the same to each element,
    so a read that saw one state of its shard has one value per shard."""
    return sum(int(values[begin:end].unique().numel() != 1) for begin, end in shard_ranges(WIDE, servers))


def asp_worker(service):
    client, w = service.client, service.worker_index
    dense = client.dense_table("dense", DENSE_INITIAL, ps.SGD(1.0))
    small = client.dense_table("small", torch.tensor([5.0, -5.0]), ps.SGD(1.0))  # fewer elements than servers
    rows = client.sparse_table("rows", ASP_ROWS, ASP_DIM, ps.SGD(1.0))
    wide = client.dense_table("wide", torch.zeros(WIDE), ps.SGD(1.0))
    dist.barrier(group=service.worker_group)  # push at the same time
    futures, wide_reads = [], []
    for i, (g, g_small, ids, g_rows, g_wide) in enumerate(asp_pushes(w)):
        grads = [g, g_small, torch.full((WIDE,), float(g_wide))]
        if i % 3 == 0:
            wide_reads.append(client.push_pull([dense, small, wide], grads))
        else:
            futures.append(client.push([dense, small, wide], grads))
        futures.append(client.push_rows([rows], [ids], [g_rows]))
        if i % 5 == 0:
            wide_reads.append(client.pull([wide, dense]))  # never waits under ASP
            futures.append(client.pull_rows([rows], [ids]))
    for future in futures + wide_reads:
        future.wait()
    torn = sum(torn_shards(next(v for v in read.value() if v.numel() == WIDE), service.num_servers)
               for read in wide_reads)
    clocks = [client.clock(dense), client.clock(small), client.clock(rows), client.clock(wide)]
    dist.barrier(group=service.worker_group)  # every worker's pushes were answered, so applied
    final_dense, final_small, final_wide = client.pull([dense, small, wide]).wait()
    final_rows = client.pull_rows([rows], [torch.arange(ASP_ROWS)]).wait()[0]
    return dict(clocks=clocks, dense=final_dense, small=final_small, rows=final_rows, wide=final_wide,
                torn=torn, wide_reads=len(wide_reads))


@pytest.mark.parametrize("servers", [1, 2, 3])
def test_asp_loses_no_concurrent_update(scenario, servers):
    workers = 2
    results, stats = scenario(workers, servers, "asp")
    pushes = [p for w in range(workers) for p in asp_pushes(w)]
    expected_dense = DENSE_INITIAL - sum(p[0] for p in pushes)  # SGD, lr 1: value - sum of every gradient
    expected_small = torch.tensor([5.0, -5.0]) - sum(p[1] for p in pushes)
    expected_rows = torch.zeros(ASP_ROWS, ASP_DIM)
    for _, _, ids, rows, _ in pushes:
        expected_rows.index_add_(0, ids, -rows)
    expected_wide = torch.full((WIDE,), -float(sum(p[4] for p in pushes)))
    for result in results:
        assert result["clocks"] == [ASP_PUSHES] * 4
        assert torch.equal(result["dense"], expected_dense), (result["dense"], expected_dense)
        assert torch.equal(result["small"], expected_small), (result["small"], expected_small)
        assert torch.equal(result["rows"], expected_rows), (result["rows"] - expected_rows)
        assert torch.equal(result["wide"], expected_wide), (result["wide"] - expected_wide).abs().max()
        # Reads answered while the other worker's pushes changed the table: none saw a half-applied one.
        assert result["torn"] == 0, result["torn"]
    # The wide table's reads were lent in place (same host), not copied: the path under test was taken.
    assert sum(s["reads_in_place"] for s in stats) >= sum(r["wide_reads"] for r in results) * servers // 2, stats
    # Every row lives on exactly one server.
    assert sum(t["rows_touched"] for s in stats for t in s["tables"] if t["name"] == "rows") == ASP_ROWS
    assert all(s["lost_workers"] == [] for s in stats)


# --- SSP: bounded staleness ---------------------------------------------------------------------------

SSP_STEPS = 6
# The slow worker's sleep before each of its pushes; a long first one gives the fast worker time to run
# its s clocks ahead however loaded the machine is.
SLOW_SLEEPS_S = [1.2] + [0.5] * (SSP_STEPS - 1)
COUNTER = 3  # elements (split 1 + 2 over two servers when there are two)


def ssp_worker(service, staleness):
    """Each clock: pull_rows the row counter; (the slow worker sleeps); push_pull +1 to the dense counter;
    push_rows +1 to the row. Returns each read with the clock it was made at (a push_pull reads at the
    clock after its push) and the counts it saw."""
    client, w = service.client, service.worker_index
    counter = client.dense_table("counter", torch.zeros(COUNTER), ps.SGD(1.0))
    wide = client.dense_table("wide", torch.zeros(WIDE), ps.SGD(1.0))  # a counter whose reads are lent in place
    rows = client.sparse_table("rows", 4, 1, ps.SGD(1.0))
    slow = w == service.num_workers - 1
    dist.barrier(group=service.worker_group)
    reads = []
    start = time.monotonic()
    for clock in range(SSP_STEPS):
        assert client.clock(counter) == clock and client.clock(wide) == clock and client.clock(rows) == clock
        row = client.pull_rows([rows], [torch.tensor([2])]).wait()[0]
        reads.append(dict(what="pull_rows", clock=clock, counts=row.flatten().tolist()))
        if slow:
            time.sleep(SLOW_SLEEPS_S[clock])
        value, wide_value = client.push_pull([counter, wide], [-torch.ones(COUNTER), -torch.ones(WIDE)]).wait()
        # Each shard of the wide counter counts as one element more, if the read saw one state of it.
        shards = shard_ranges(WIDE, service.num_servers)
        assert torn_shards(wide_value, service.num_servers) == 0, (clock, wide_value.unique())
        reads.append(dict(what="push_pull", clock=clock + 1,
                          counts=value.tolist() + [wide_value[begin].item() for begin, _ in shards]))
        client.push_rows([rows], [torch.tensor([2])], [-torch.ones(1, 1)]).wait()
    return dict(slow=slow, reads=reads, elapsed=time.monotonic() - start)


def others_pushes_seen(read):
    """The fewest of the other worker's pushes any element of the read included (its own are all in)."""
    return min(read["counts"]) - read["clock"]


def two_workers(results):
    fast, slow = results
    assert not fast["slow"] and slow["slow"]
    for result in results:
        assert len(result["reads"]) == 2 * SSP_STEPS
        for read in result["reads"]:
            # Integer counts: every element saw its own pushes and between none and all of the other's.
            assert all(v == int(v) for v in read["counts"]), read
            assert read["clock"] <= min(read["counts"]) and max(read["counts"]) <= read["clock"] + SSP_STEPS, read
    return fast, slow


@pytest.mark.parametrize("staleness,servers", [(1, 1), (2, 2)])
def test_ssp_bounds_staleness_and_blocks_the_fast_worker(scenario, staleness, servers):
    results, stats = scenario(2, servers, f"ssp{staleness}")
    fast, slow = two_workers(results)
    for result in (fast, slow):
        for read in result["reads"]:
            # A read at clock c waits for every worker's pushes of clocks < c - s.
            assert others_pushes_seen(read) >= read["clock"] - staleness, (read, result["reads"])
    ahead = [read["clock"] - others_pushes_seen(read) for read in fast["reads"]]
    assert max(ahead) == staleness, f"the fast worker should run exactly s={staleness} clocks ahead: {ahead}"
    # It blocked: its last push_pull (read at clock SSP_STEPS) needed SSP_STEPS - s of the slow worker's
    # pushes, each made after one of its sleeps.
    assert fast["elapsed"] >= 0.9 * sum(SLOW_SLEEPS_S[:SSP_STEPS - staleness]), fast
    assert all(s["max_staleness"] <= staleness for s in stats), stats
    assert max(s["max_staleness"] for s in stats) == staleness, stats
    assert all(s["reads_in_place"] >= SSP_STEPS for s in stats), stats  # the wide counter's reads


def test_asp_lets_the_fast_worker_run_ahead(scenario):
    """The contrast to the SSP test: without the bound, the fast worker's reads trail by more than s=1."""
    staleness = 1
    results, stats = scenario(2, 1, "asp_ahead")
    fast, _ = two_workers(results)
    ahead = [read["clock"] - others_pushes_seen(read) for read in fast["reads"]]
    assert max(ahead) > staleness + 1, ahead
    assert stats[0]["max_staleness"] > staleness + 1, stats


WAITING_IDS = torch.arange(4096) * 7 % 100_003  # 4096 distinct ids: a 32 KiB request, past the frame


def waiting_read_worker(service):
    """SSP with staleness 0: the fast worker's pull_rows waits for the slow worker's push, and while it
    waits the fast worker sends a large push_pull. On one host both requests travel through the same
    shared-memory ring, at the same place (the ring is empty each time); the server must read the waiting
    request from a copy of its own, not from the ring the next request overwrote."""
    client, w = service.client, service.worker_index
    rows = client.sparse_table("waiting.rows", 100_003, 4, ps.SGD(1.0))
    filler = client.dense_table("waiting.filler", torch.zeros(100_000), ps.SGD(1.0))
    dist.barrier(group=service.worker_group)
    if w == 1:
        time.sleep(1.0)  # the slow worker: the fast one's read below waits for this push
    client.push_rows([rows], [WAITING_IDS], [-torch.ones(len(WAITING_IDS), 4)]).wait()
    waiting = client.pull_rows([rows], [WAITING_IDS])
    if w == 0:
        time.sleep(0.3)  # the server has taken the read, which waits, and handed its ring bytes back
    client.push_pull([filler], [torch.full((100_000,), -1.0)])  # into the ring where the read was
    return dict(rows=waiting.wait()[0])


def test_a_read_that_waits_keeps_its_request_when_the_next_one_reuses_the_ring(scenario):
    results, _ = scenario(2, 1, "waiting_read")
    for result in results:
        # Both workers pushed +1 to every row of WAITING_IDS before the read at clock 1 was answered.
        assert torch.equal(result["rows"], torch.full((len(WAITING_IDS), 4), 2.0)), result["rows"]


# --- One launch per world size, its services one after another -----------------------------------------

WORLDS = {  # (workers, servers): scenarios (name, body, args, service options)
    (2, 1): [("asp", asp_worker, (), dict(consistency="asp")),
             ("ssp1", ssp_worker, (1,), dict(consistency="ssp", staleness=1)),
             ("asp_ahead", ssp_worker, (1,), dict(consistency="asp")),
             ("waiting_read", waiting_read_worker, (), dict(consistency="ssp", staleness=0))],
    (2, 2): [("bsp", bsp_worker, (2,), dict(consistency="bsp")),
             ("asp", asp_worker, (), dict(consistency="asp")),
             ("ssp2", ssp_worker, (2,), dict(consistency="ssp", staleness=2))],
    (3, 1): [("bsp", bsp_worker, (3,), dict(consistency="bsp"))],
    (2, 3): [("asp", asp_worker, (), dict(consistency="asp"))],
}


@pytest.fixture(scope="module")
def scenario():
    """scenario(workers, servers, name) -> (worker values, server statistics); each world launched once."""
    launched = {}

    def get(workers, servers, name):
        world = (workers, servers)
        if world not in launched:
            try:
                launched[world] = run_scenarios(workers, servers, WORLDS[world], deadline_s=240)
            except AssertionError as failure:  # the launch failed: every test of this world reports it
                launched[world] = failure
        if isinstance(launched[world], AssertionError):
            raise launched[world]
        return launched[world][name]

    return get
