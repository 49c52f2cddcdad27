"""torchpar's Python DDP against single-process training (1e-5) and against torch's own DDP (1e-6)."""
import copy

import pytest
import torch
from torch import nn

import torchpar
from ddp_reference import global_batches, loss_of, make_model, max_difference, shard, train_step_beside_reference
from rank_harness import run_on_ranks

STEPS = 4
PER_RANK = 6
# (bucket_cap_mb, gradient_as_bucket_view): one parameter per bucket, one bucket for all, default.
BUCKETINGS = [(1e-9, False), (1e-9, True), (1000.0, False), (1000.0, True)]
MODELS = ["mlp", "cnn_bn", "embedding"]


def train_against_reference(rank, world, model_name, bucket_cap_mb, as_view):
    model = make_model(model_name)
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.2, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    for batch in global_batches(model_name, STEPS, world, PER_RANK):
        # With bucket views, keep .grad tensors alive between steps (in-place accumulation path).
        train_step_beside_reference(
            ddp, optimizer, reference, reference_optimizer, batch, rank, world, set_to_none=not as_view
        )
    buckets = ddp.bucket_indices()
    if as_view:
        for bucket in buckets:
            storages = {list(model.parameters())[i].grad.untyped_storage().data_ptr() for i in bucket}
            assert len(storages) == 1, f"gradients of bucket {bucket} are not views of one flat bucket"
    if bucket_cap_mb < 1e-6:
        assert all(len(bucket) == 1 for bucket in buckets), buckets
    else:
        assert len(buckets) == 1, buckets
    difference = max_difference(model, reference)
    assert difference < 1e-5, f"{model_name} cap={bucket_cap_mb} view={as_view}: differs by {difference:.3g}"
    if rank == 0:
        for (name, ours), theirs in zip(model.named_buffers(), reference.buffers()):
            assert torch.allclose(ours.float(), theirs.float(), atol=1e-5), f"buffer {name} differs"
    return [p.detach() for p in model.parameters()]


def all_configs_against_reference(rank, world):
    replicas = []
    for model_name in MODELS:
        for bucket_cap_mb, as_view in BUCKETINGS:
            replicas.append(train_against_reference(rank, world, model_name, bucket_cap_mb, as_view))
    return replicas


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_training_equals_single_process_training(backend, world):
    replicas = run_on_ranks(world, all_configs_against_reference, backend=backend, deadline_s=240)
    for rank in range(1, world):
        for config, (ours, first) in enumerate(zip(replicas[rank], replicas[0])):
            for a, b in zip(ours, first):
                assert torch.equal(a, b), f"config {config}: rank {rank}'s parameters differ from rank 0's"


def train_beside_torch_ddp(rank, world, model_name):
    model = make_model(model_name)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ours = torchpar.DistributedDataParallel(model)
    assert list(ours.state_dict().keys()) == list(theirs.state_dict().keys())
    our_optimizer = torch.optim.SGD(ours.parameters(), lr=0.2, momentum=0.9)
    their_optimizer = torch.optim.SGD(theirs.parameters(), lr=0.2, momentum=0.9)
    for batch in global_batches(model_name, 6, world, PER_RANK):
        inputs, targets = shard(batch, rank, world)
        for ddp, optimizer in ((ours, our_optimizer), (theirs, their_optimizer)):
            optimizer.zero_grad()
            loss_of(ddp(inputs), targets).backward()
            optimizer.step()
    difference = max_difference(ours.module, theirs.module)
    assert difference < 1e-6, f"{model_name}: torchpar and torch DDP differ by {difference:.3g}"


def all_models_beside_torch_ddp(rank, world):
    for model_name in MODELS:
        train_beside_torch_ddp(rank, world, model_name)


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@pytest.mark.parametrize("world", [2, 3])
def test_parameters_equal_torch_ddp(backend, world):
    run_on_ranks(world, all_models_beside_torch_ddp, backend=backend)


def bucket_layouts(rank, world, bucket_cap_mb):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    options = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), **options)
    ours = torchpar.DistributedDataParallel(model, **options)
    inputs, targets = torch.randn(8, 64), torch.randint(0, 10, (8,))
    for ddp in (theirs, ours):
        for _ in range(3):  # the second forward rebuilds the buckets from the observed order
            loss_of(ddp(inputs), targets).backward()
    their_layout = [
        [int(i) for i in bucket.split()]
        for bucket in theirs._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"].split(",")
    ]
    return their_layout, ours.bucket_indices()


@pytest.mark.parametrize("bucket_cap_mb", [None, 25, 0.5])
def test_bucket_layout_after_rebuild_matches_torch_ddp(bucket_cap_mb):
    # Default: a 1 MiB first bucket; an explicit bucket_cap_mb applies to the first bucket too (as in torch).
    theirs, ours = run_on_ranks(2, bucket_layouts, bucket_cap_mb)[0]
    assert ours == theirs
