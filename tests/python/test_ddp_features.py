"""DDP options and extensions against single-process references: find_unused_parameters, static_graph,
no_sync, communication hooks (C++ built-ins, PowerSGD, Python callables), join, the timeline."""
import copy
import json

import pytest
import torch
import torch.distributed as dist

import torchpar
from ddp_reference import (
    global_batches, loss_of, make_model, max_difference, reference_step, shard, train_step_beside_reference,
)
from rank_harness import run_on_ranks

PER_RANK = 6


def rare_branch_used(step: int, rank: int, varies_by_rank: bool) -> bool:
    return (step + rank) % 2 == 0 if varies_by_rank else step % 2 == 0


def train_two_branch(rank, world, varies_by_rank, static_graph):
    model = make_model("two_branch")
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(
        model, find_unused_parameters=not static_graph, static_graph=static_graph, bucket_cap_mb=1e-9
    )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.2)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    for step, batch in enumerate(global_batches("two_branch", 6, world, PER_RANK)):
        use_rare = rare_branch_used(step, rank, varies_by_rank)
        optimizer.zero_grad()
        inputs, targets = shard(batch, rank, world)
        loss_of(ddp(inputs, use_rare=use_rare), targets).backward()
        # No rank ever uses `never`: its gradient stays None, as in single-process training.
        assert model.never.weight.grad is None
        optimizer.step()
        reference_optimizer.zero_grad()
        reference_step(
            reference, batch, world,
            forward=lambda m, x, r: m(x, use_rare=rare_branch_used(step, r, varies_by_rank)),
        )
        reference_optimizer.step()
    difference = max_difference(model, reference)
    assert difference < 1e-5, f"differs from single-process training by {difference:.3g}"
    return ddp._coordinator.buckets_rebuilt


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@pytest.mark.parametrize("varies_by_rank", [False, True], ids=["same_branch", "branch_per_rank"])
def test_find_unused_parameters_with_a_branch_used_on_some_iterations(backend, varies_by_rank):
    run_on_ranks(3, train_two_branch, varies_by_rank, False, backend=backend)


def test_static_graph_learns_unused_parameters_and_rebuilds_buckets():
    # static_graph: the same set is unused every iteration (only `never` here, rare always used).
    rebuilt = run_on_ranks(2, train_static, backend="gloo")
    assert rebuilt == [True, True]


def train_static(rank, world):
    model = make_model("two_branch")
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model, static_graph=True, bucket_cap_mb=1e-9)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.2)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    first_buckets = ddp.bucket_indices()
    for batch in global_batches("two_branch", 5, world, PER_RANK):
        train_step_beside_reference(
            ddp, optimizer, reference, reference_optimizer, batch, rank, world,
            forward=lambda m, x, r: m(x, use_rare=True),
        )
        assert model.never.weight.grad is None
    assert max_difference(model, reference) < 1e-5
    # Rebuilt from the observed order: `never` (marked ready first, being unused) leads.
    assert ddp.bucket_indices() != first_buckets
    return ddp._coordinator.buckets_rebuilt


def unused_without_the_option(rank, world):
    ddp = torchpar.DistributedDataParallel(make_model("two_branch"))
    inputs, targets = shard(global_batches("two_branch", 1, world, PER_RANK)[0], rank, world)
    try:
        loss_of(ddp(inputs), targets).backward()
    except RuntimeError as error:
        return str(error)
    raise AssertionError("backward with unused parameters and find_unused_parameters=False did not fail")


def test_unused_parameter_without_find_unused_is_a_clear_error_not_a_hang():
    messages = run_on_ranks(2, unused_without_the_option, deadline_s=60, collective_timeout_s=20)
    for message in messages:
        assert "rare.weight" in message and "never.weight" in message, message
        assert "find_unused_parameters" in message, message


def no_sync_accumulation(rank, world, k, as_view):
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model, gradient_as_bucket_view=as_view)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.2)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    for batch in global_batches("mlp", 3, world, PER_RANK * k):
        optimizer.zero_grad()
        inputs, targets = shard(batch, rank, world)
        micro = list(zip(inputs.chunk(k), targets.chunk(k)))
        with ddp.no_sync():
            for x, y in micro[:-1]:
                (loss_of(ddp(x), y) / k).backward()
        x, y = micro[-1]
        (loss_of(ddp(x), y) / k).backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        reference_step(reference, batch, world)  # one step on the k-times larger batch
        reference_optimizer.step()
    difference = max_difference(model, reference)
    assert difference < 1e-5, f"no_sync x{k} differs from one big step by {difference:.3g}"


@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "bucket_view"])
def test_no_sync_over_k_steps_equals_one_step_on_k_times_the_batch(as_view):
    run_on_ranks(2, no_sync_accumulation, 3, as_view, backend="shm")


def torch_allreduce_hook(state, bucket):
    # A Python hook, the way torch documents them: average, then all-reduce asynchronously.
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def train_with_hook(rank, world, hook_name):
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model, bucket_cap_mb=1e-3)
    hook = {
        "fp16": torchpar.ddp.fp16_compress_hook,
        "bf16": torchpar.ddp.bf16_compress_hook,
        "allreduce": torchpar.ddp.allreduce_hook,
        "python": torch_allreduce_hook,
    }[hook_name]
    ddp.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.2)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    for batch in global_batches("mlp", 4, world, PER_RANK):
        train_step_beside_reference(ddp, optimizer, reference, reference_optimizer, batch, rank, world)
    assert len(ddp.bucket_indices()) > 1
    return max_difference(model, reference)


@pytest.mark.parametrize(
    "hook_name,tolerance", [("allreduce", 1e-6), ("python", 1e-6), ("fp16", 2e-3), ("bf16", 2e-2)]
)
def test_comm_hooks_match_single_process_training_within_their_precision(hook_name, tolerance):
    differences = run_on_ranks(2, train_with_hook, hook_name, backend="gloo")
    assert max(differences) < tolerance, differences
    if hook_name in ("fp16", "bf16"):
        assert max(differences) > 0, "a compressing hook cannot be bit-exact: was it used at all?"


def powersgd_digits(rank, world):
    from sklearn.datasets import load_digits

    digits = load_digits()
    data = torch.tensor(digits.data, dtype=torch.float32) / 16
    labels = torch.tensor(digits.target)
    permutation = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    train, test = permutation[:1400], permutation[1400:]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    ddp = torchpar.DistributedDataParallel(model)
    ddp.register_comm_hook(
        torchpar.ddp.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=5), torchpar.ddp.powerSGD_hook
    )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    local = train[rank::world]
    for epoch in range(8):
        order = local[torch.randperm(len(local), generator=torch.Generator().manual_seed(epoch))]
        for batch in order.split(32):
            if len(batch) < 32:
                break  # equal batch counts on every rank
            optimizer.zero_grad()
            loss_of(ddp(data[batch]), labels[batch]).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = (model(data[test]).argmax(1) == labels[test]).float().mean().item()
    return accuracy, [p.detach().clone() for p in model.parameters()]


def test_powersgd_trains_the_digits_mlp_to_90_percent():
    results = run_on_ranks(2, powersgd_digits, backend="shm", deadline_s=180)
    accuracy = results[0][0]
    assert accuracy >= 0.90, f"PowerSGD reached only {accuracy:.1%}"
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b), "PowerSGD left the replicas different"


def uneven_join(rank, world):
    batches_per_rank = [3 + 2 * r for r in range(world)]
    steps = max(batches_per_rank)
    model = make_model("cnn_bn")
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model, bucket_cap_mb=1e-9)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = global_batches("cnn_bn", steps, world, PER_RANK)
    with ddp.join():
        for batch in batches[: batches_per_rank[rank]]:
            optimizer.zero_grad()
            inputs, targets = shard(batch, rank, world)
            loss_of(ddp(inputs), targets).backward()
            optimizer.step()
    # Reference: at each step the active ranks' gradients, divided by the initial world size.
    for step, batch in enumerate(batches):
        active = [r for r in range(world) if step < batches_per_rank[r]]
        reference_optimizer.zero_grad()
        reference_step(reference, batch, world, active_ranks=[max(active)] + [r for r in active if r != max(active)])
        reference_optimizer.step()
    difference = max_difference(model, reference)
    assert difference < 1e-5, f"after join, rank {rank} differs from the reference by {difference:.3g}"
    return [p.detach().clone() for p in model.parameters()] + [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_join_with_uneven_batch_counts_ends_cleanly_with_equal_parameters(backend):
    replicas = run_on_ranks(3, uneven_join, backend=backend, deadline_s=120, collective_timeout_s=30)
    for rank in range(1, 3):
        for a, b in zip(replicas[rank], replicas[0]):
            assert torch.equal(a, b), f"rank {rank} ends with a different model than rank 0"


def traced_training(rank, world, path):
    import os

    os.environ["TORCHPAR_TIMELINE"] = path
    ddp = torchpar.DistributedDataParallel(make_model("mlp"), bucket_cap_mb=1e-9)
    for batch in global_batches("mlp", 3, world, PER_RANK):
        inputs, targets = shard(batch, rank, world)
        loss_of(ddp(inputs), targets).backward()
    second = torchpar.DistributedDataParallel(make_model("mlp"))  # must not overwrite the first's trace
    return ddp._coordinator.timeline_path, second._coordinator.timeline_path


def test_timeline_records_forward_backward_and_overlapping_allreduces(tmp_path):
    results = run_on_ranks(2, traced_training, str(tmp_path / "trace.json"))
    paths = [first for first, _ in results]
    assert paths == [str(tmp_path / "trace.rank0.json"), str(tmp_path / "trace.rank1.json")]
    assert [second for _, second in results] == [str(tmp_path / f"trace.rank{r}.1.json") for r in range(2)]
    for path in paths:
        events = json.loads(open(path).read())
        names = [event["name"] for event in events]
        assert names.count("forward") == 3 and names.count("backward") == 3, names
        assert sum(name.startswith("allreduce bucket") for name in names) == 3 * 6  # 6 buckets x 3 steps
        assert sum(name.endswith(" ready") for name in names) == 3 * 6
        backward = next(e for e in events if e["name"] == "backward")
        first_allreduce = min(
            (e for e in events if e["name"].startswith("allreduce bucket")), key=lambda e: e["ts"]
        )
        # The first bucket's all-reduce starts while backward is still running: communication overlaps.
        assert backward["ts"] <= first_allreduce["ts"] < backward["ts"] + backward["dur"]


def no_sync_then_unused(rank, world):
    k = 2
    model = make_model("two_branch")
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.2)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    for batch in global_batches("two_branch", 3, world, PER_RANK * k):
        optimizer.zero_grad()
        (first_x, last_x), (first_y, last_y) = (t.chunk(k) for t in shard(batch, rank, world))
        with ddp.no_sync():  # the rare branch is used only in the accumulated micro-batch
            (loss_of(ddp(first_x, use_rare=True), first_y) / k).backward()
        (loss_of(ddp(last_x), last_y) / k).backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        for r in range(world):
            (first_x, last_x), (first_y, last_y) = (t.chunk(k) for t in shard(batch, r, world))
            (loss_of(reference(first_x, use_rare=True), first_y) / k / world).backward()
            (loss_of(reference(last_x), last_y) / k / world).backward()
        reference_optimizer.step()
    difference = max_difference(model, reference)
    assert difference < 1e-5, f"a gradient accumulated under no_sync was lost or not averaged: {difference:.3g}"


def test_gradients_accumulated_under_no_sync_count_even_if_the_synced_step_leaves_them_unused():
    run_on_ranks(2, no_sync_then_unused)
