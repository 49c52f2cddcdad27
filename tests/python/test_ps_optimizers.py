"""The servers' optimizers move a table exactly as torch.optim moves a parameter given the same gradients.

Dense tables (shape [7, 3]: 21 elements, split 10 + 11 over two servers) follow torch.optim's SGD with
momentum and weight decay, Adagrad and Adam, in float32 and float64. Sparse rows follow torch.optim
applied to each row alone, stepped only when a push touched it, with the row's duplicates summed.
A learning rate changed at run time acts as a changed param_group lr. One worker, so BSP's mean is the
gradient itself; one launch per server count checks every optimizer at once.
"""
import pytest
import torch

from ps_helpers import run_service

import torchpar.ps as ps

STEPS = 5
LR_CHANGE_STEP = 3  # set_learning_rate before this step's push
LR_SCALE = 0.3
SHAPE = (7, 3)
NUM_ROWS, DIM = 16, 3
ROW_INIT = dict(low=-1.0, high=1.0, seed=7)

# name: (optimizer, keyword arguments valid for both ps.<optimizer> and torch.optim.<optimizer>, dtype)
DENSE_CASES = {
    "sgd": ("SGD", dict(lr=0.1), torch.float32),
    "sgd_momentum_wd": ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.05), torch.float32),
    "adagrad_wd": ("Adagrad", dict(lr=0.1, eps=1e-10, initial_accumulator_value=0.2, weight_decay=0.05),
                   torch.float32),
    "adam_wd": ("Adam", dict(lr=0.05, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.05), torch.float32),
    "sgd_momentum_f64": ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.05), torch.float64),
    "adagrad_f64": ("Adagrad", dict(lr=0.1, initial_accumulator_value=0.2), torch.float64),
    "adam_wd_f64": ("Adam", dict(lr=0.05, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.05), torch.float64),
}
SPARSE_CASES = {
    "sgd": ("SGD", dict(lr=0.1), torch.float32),
    "adagrad": ("Adagrad", dict(lr=0.1, eps=1e-10), torch.float32),
    "adagrad_initial_accumulator": ("Adagrad", dict(lr=0.1, initial_accumulator_value=0.2), torch.float32),
    "adam": ("Adam", dict(lr=0.05, betas=(0.8, 0.99), eps=1e-8), torch.float32),
    "adam_f64": ("Adam", dict(lr=0.05, betas=(0.8, 0.99), eps=1e-8), torch.float64),
}
# Per step, the ids pushed: duplicates within a push, rows touched at some steps only, rows 4, 6, 8,
# 10, 12, 14, 15 never pushed (read only: they keep the initializer's values). Even-length lists are
# pushed as [n/2, 2] ids (gradients [n/2, 2, DIM]) to cover ids of more than one dimension.
SPARSE_IDS = [
    [0, 1, 1, 5, 9],
    [1, 2, 2, 2],
    [0, 5, 7, 7, 11, 3],
    [9, 1],
    [2, 5, 5, 0, 13, 13, 13],
]
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}


def dense_initial(name):
    dtype = DENSE_CASES[name][2]
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(SHAPE, generator=generator, dtype=torch.float64).to(dtype)


def dense_grad(name, step):
    dtype = DENSE_CASES[name][2]
    generator = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randn(SHAPE, generator=generator, dtype=torch.float64).to(dtype)


def sparse_ids(step):
    ids = torch.tensor(SPARSE_IDS[step])
    return ids.view(-1, 2) if len(ids) % 2 == 0 else ids


def sparse_grad(name, step):
    dtype = SPARSE_CASES[name][2]
    generator = torch.Generator().manual_seed(7000 + 1000 * step + sum(map(ord, name)))
    return torch.randn(*sparse_ids(step).shape, DIM, generator=generator, dtype=torch.float64).to(dtype)


def optimizer_worker(service):
    client = service.client
    dense = {name: client.dense_table("dense." + name, dense_initial(name), getattr(ps, kind)(**kwargs))
             for name, (kind, kwargs, _) in DENSE_CASES.items()}
    initializer = ps.uniform(**ROW_INIT)
    sparse = {name: client.sparse_table("sparse." + name, NUM_ROWS, DIM, getattr(ps, kind)(**kwargs), initializer,
                                        dtype)
              for name, (kind, kwargs, dtype) in SPARSE_CASES.items()}
    dense_tables, sparse_tables = list(dense.values()), list(sparse.values())
    all_rows = [torch.arange(NUM_ROWS)] * len(sparse_tables)
    dense_values, row_values = [], []
    row_values.append(client.pull_rows(sparse_tables, all_rows).wait())
    for step in range(STEPS):
        if step == LR_CHANGE_STEP:
            for name, table in dense.items():
                client.set_learning_rate(table, DENSE_CASES[name][1]["lr"] * LR_SCALE)
            for name, table in sparse.items():
                client.set_learning_rate(table, SPARSE_CASES[name][1]["lr"] * LR_SCALE)
        # Every table in one request per server.
        dense_values.append(client.push_pull(dense_tables, [dense_grad(name, step) for name in dense]).wait())
        client.push_rows(sparse_tables, [sparse_ids(step)] * len(sparse_tables),
                         [sparse_grad(name, step) for name in sparse]).wait()
        row_values.append(client.pull_rows(sparse_tables, all_rows).wait())
    clocks = {name: client.clock(table) for name, table in {**dense, **sparse}.items()}

    refusals = {}
    refused = [("momentum", ps.SGD(0.1, momentum=0.9)), ("weight decay", ps.Adagrad(0.1, weight_decay=0.1))]
    for label, optimizer in refused:
        try:
            client.sparse_table("refused", NUM_ROWS, DIM, optimizer)
            refusals[label] = None
        except RuntimeError as error:
            refusals[label] = str(error)
    # The refusals left the servers serving, and the name free for a valid registration.
    accepted = client.sparse_table("refused", NUM_ROWS, DIM, ps.SGD(1.0))
    client.push_rows([accepted], [torch.tensor([3, 3])], [torch.ones(2, DIM)]).wait()
    accepted_row = client.pull_rows([accepted], [torch.tensor([3])]).wait()[0]
    return dict(
        dense={name: [values[i] for values in dense_values] for i, name in enumerate(dense)},
        rows={name: [values[i] for values in row_values] for i, name in enumerate(sparse)},
        clocks=clocks, refusals=refusals, accepted_row=accepted_row,
    )


def set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr


def expected_dense(name):
    kind, kwargs, _ = DENSE_CASES[name]
    parameter = dense_initial(name).clone().requires_grad_()
    optimizer = getattr(torch.optim, kind)([parameter], **kwargs)
    values = []
    for step in range(STEPS):
        if step == LR_CHANGE_STEP:
            set_lr(optimizer, kwargs["lr"] * LR_SCALE)
        parameter.grad = dense_grad(name, step)
        optimizer.step()
        values.append(parameter.detach().clone())
    return values


def expected_rows(name):
    """Each row a parameter of its own, stepped only when touched, with its duplicates' gradients summed."""
    kind, kwargs, dtype = SPARSE_CASES[name]
    initial = ps.initial_rows(ps.uniform(**ROW_INIT), torch.arange(NUM_ROWS), DIM).to(dtype)
    rows = [initial[r].clone().requires_grad_() for r in range(NUM_ROWS)]
    optimizers = [getattr(torch.optim, kind)([row], **kwargs) for row in rows]
    values = [torch.stack([row.detach().clone() for row in rows])]
    for step in range(STEPS):
        if step == LR_CHANGE_STEP:
            for optimizer in optimizers:
                set_lr(optimizer, kwargs["lr"] * LR_SCALE)
        ids, grads = sparse_ids(step).reshape(-1), sparse_grad(name, step).reshape(-1, DIM)
        for r in ids.unique().tolist():
            rows[r].grad = grads[ids == r].sum(0)
            optimizers[r].step()
        values.append(torch.stack([row.detach().clone() for row in rows]))
    return values


@pytest.fixture(scope="module", params=[1, 2], ids=["1server", "2servers"])
def served(request):
    (result,), stats = run_service(1, request.param, optimizer_worker, deadline_s=240)
    return result, stats


@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_dense_table_follows_torch_optim(served, name):
    result, _ = served
    got, expected = result["dense"][name], expected_dense(name)
    dtype = DENSE_CASES[name][2]
    assert len(got) == STEPS
    for step, (value, reference) in enumerate(zip(got, expected)):
        assert value.dtype == dtype and value.shape == SHAPE
        torch.testing.assert_close(value, reference, atol=TOLERANCE[dtype], rtol=0,
                                   msg=lambda m: f"dense {name}, after step {step}: {m}")
    assert not torch.allclose(got[-1], dense_initial(name), atol=1e-3)  # it really trained
    assert result["clocks"][name] == STEPS


@pytest.mark.parametrize("name", list(SPARSE_CASES))
def test_sparse_rows_follow_torch_optim_row_by_row(served, name):
    result, _ = served
    got, expected = result["rows"][name], expected_rows(name)
    dtype = SPARSE_CASES[name][2]
    assert len(got) == STEPS + 1
    for step, (value, reference) in enumerate(zip(got, expected)):
        assert value.dtype == dtype and value.shape == (NUM_ROWS, DIM)
        torch.testing.assert_close(value, reference, atol=TOLERANCE[dtype], rtol=0,
                                   msg=lambda m: f"sparse {name}, after {step} steps: {m}")
    touched = sorted(set(sum(SPARSE_IDS, [])))
    untouched = sorted(set(range(NUM_ROWS)) - set(touched))
    assert torch.equal(got[-1][untouched], got[0][untouched])  # read-only rows keep their first values
    assert (got[-1][touched] - got[0][touched]).abs().amax(1).min() > 1e-3  # every pushed row moved
    assert result["clocks"][name] == STEPS


def test_sparse_rows_refuse_momentum_and_weight_decay(served):
    result, stats = served
    assert result["refusals"]["momentum"] is not None, "a sparse table with SGD momentum was accepted"
    assert "momentum" in result["refusals"]["momentum"] and "'refused'" in result["refusals"]["momentum"]
    assert result["refusals"]["weight decay"] is not None, "a sparse table with weight decay was accepted"
    assert "weight decay" in result["refusals"]["weight decay"]
    # After the refusals the name registered with plain SGD and took a push (ids 3, 3 summed: -2).
    torch.testing.assert_close(result["accepted_row"][0], torch.full((DIM,), -2.0))
    sparse_tables = {table["name"] for s in stats for table in s["tables"] if table["sparse"]}
    assert sparse_tables == {"sparse." + name for name in SPARSE_CASES} | {"refused"}
