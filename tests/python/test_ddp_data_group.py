"""DDP over a Gloo group on one host: the gradient buckets (and the buffers' broadcasts) go through a
same-host shm group beside it, and training still equals single-process training
(TORCHPAR_DDP_SAME_HOST=0 keeps them on Gloo)."""
import copy
import os

import pytest
import torch
import torch.distributed as dist

import torchpar
from ddp_reference import global_batches, make_model, max_difference, train_step_beside_reference
from rank_harness import run_on_ranks

STEPS = 3
PER_RANK = 6


def shm_ops(group) -> int:
    """Collectives issued on an shm group so far (the backend counts them)."""
    return group._get_backend(torch.device("cpu"))._get_sequence_number_for_group()


def train_and_count(rank, world, bucket_cap_mb, same_host="1", model_name="mlp"):
    os.environ["TORCHPAR_DDP_SAME_HOST"] = same_host  # the ranks' processes are forked ahead of the test
    model = make_model(model_name)
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.2, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    group = ddp._data_group
    counts = []
    for batch in global_batches(model_name, STEPS, world, PER_RANK):
        before = shm_ops(group) if group is not None else 0
        train_step_beside_reference(ddp, optimizer, reference, reference_optimizer, batch, rank, world)
        counts.append(shm_ops(group) - before if group is not None else None)
    difference = max_difference(model, reference)
    assert difference < 1e-5, f"differs from single-process training by {difference:.3g}"
    for (name, ours), theirs in zip(model.named_buffers(), reference.buffers()):
        assert rank != 0 or torch.allclose(ours.float(), theirs.float(), atol=1e-5), f"buffer {name} differs"
    # A second model over the same Gloo group reuses the shm group.
    second = torchpar.DistributedDataParallel(make_model("mlp"))
    return {
        "backend": dist.get_backend(group) if group is not None else None,
        "buckets": len(ddp.bucket_indices()),
        "counts": counts,
        "shared": second._data_group is group,
        "parameters": [p.detach() for p in model.parameters()],
    }


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_group_on_one_host_reduces_buckets_through_shm(world):
    results = run_on_ranks(world, train_and_count, 1e-9)  # one parameter per bucket: 6 buckets
    for result in results:
        assert result["backend"] == "shm"
        assert result["shared"]
        # Every bucket of every step went through the shm group, and nothing else did.
        assert result["counts"] == [result["buckets"]] * STEPS, (result["counts"], result["buckets"])
        assert result["buckets"] == 6
    for result in results[1:]:
        for ours, first in zip(result["parameters"], results[0]["parameters"]):
            assert torch.equal(ours, first)


def test_buffers_are_broadcast_through_shm_too():
    results = run_on_ranks(2, train_and_count, 1000.0, "1", "cnn_bn")  # BatchNorm: buffers to broadcast
    for result in results:
        assert result["buckets"] == 1
        # Each step: rank 0's buffers broadcast before the forward, then the one bucket.
        assert all(count > 1 for count in result["counts"]), result["counts"]
    for ours, first in zip(results[1]["parameters"], results[0]["parameters"]):
        assert torch.equal(ours, first)


def test_same_host_off_keeps_buckets_on_gloo():
    results = run_on_ranks(2, train_and_count, 1000.0, "0")
    assert all(result["backend"] is None and result["counts"] == [None] * STEPS for result in results)
    for ours, first in zip(results[1]["parameters"], results[0]["parameters"]):
        assert torch.equal(ours, first)


def no_data_group_on_shm(rank, world):
    return torchpar.DistributedDataParallel(make_model("mlp"))._data_group


def test_shm_group_needs_no_second_group():
    assert run_on_ranks(2, no_data_group_on_shm, backend="shm") == [None, None]


def mismatched_data_group(rank, world):
    reversed_ranks = dist.new_group([1, 0], sort_ranks=False)  # this rank is the other's number there
    model = make_model("mlp")
    with pytest.raises(RuntimeError, match="data_process_group must hold the process group's ranks"):
        torchpar._C.ddp.ReplicaCoordinator(
            list(model.named_parameters()), [], dist.group.WORLD, bucket_cap_mb=25.0, first_bucket_cap_mb=1.0,
            bucket_cap_mb_list=[], find_unused_parameters=False, gradient_as_bucket_view=False,
            broadcast_buffers=True, static_graph=False, init_sync=False, init_sync_buffers=False,
            data_process_group=reversed_ranks)


def test_data_group_of_other_rank_order_is_refused():
    run_on_ranks(2, mismatched_data_group)


def ddp_on_a_subgroup_then_a_group_of_all(rank, world):
    subgroup = dist.new_group([0, 1])
    if rank < 2:  # only the subgroup's ranks wrap a model; they alone make its shm group
        ddp = torchpar.DistributedDataParallel(make_model("mlp"), process_group=subgroup)
        assert dist.get_backend(ddp._data_group) == "shm"
    everyone = dist.new_group(list(range(world)))
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    return total.item()


def test_a_subgroups_shm_group_leaves_later_groups_of_all_ranks_alike():
    # dist.new_group numbers groups by a per-rank count: an shm group made through it on ranks 0 and 1 only
    # would give the next group of all four ranks different names, and its rendezvous would hang.
    assert run_on_ranks(4, ddp_on_a_subgroup_then_a_group_of_all, deadline_s=60) == [4.0] * 4


def builtin_hook_ops(rank, world, hook_name):
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model, bucket_cap_mb=1e-9)
    if hook_name == "powerSGD":
        ddp.register_comm_hook(torchpar.ddp.PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=2),
                               torchpar.ddp.powerSGD_hook)
    else:
        # The DDP's own group named as the state means the same ranks: the hook goes through shm all the same.
        state = dist.group.WORLD if hook_name == "fp16-given-group" else None
        ddp.register_comm_hook(state, torchpar.ddp.fp16_compress_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.2)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    counts = []
    for batch in global_batches("mlp", 3, world, PER_RANK):
        before = shm_ops(ddp._data_group)
        train_step_beside_reference(ddp, optimizer, reference, reference_optimizer, batch, rank, world)
        counts.append(shm_ops(ddp._data_group) - before)
    return counts, len(ddp.bucket_indices()), max_difference(model, reference)


@pytest.mark.parametrize("hook_name", ["fp16", "fp16-given-group", "powerSGD"])
def test_builtin_comm_hooks_on_a_gloo_group_go_through_shm(hook_name):
    for counts, buckets, difference in run_on_ranks(2, builtin_hook_ops, hook_name):
        assert buckets == 6  # one parameter each: 3 weight matrices, 3 bias vectors
        if hook_name == "powerSGD":
            # Plain all-reduces for its first 2 iterations; then P and Q for each matrix, one for each vector.
            assert counts == [6, 6, 9], counts
            assert difference < 0.05, difference
        else:
            assert counts == [6, 6, 6], counts
            assert 0 < difference < 2e-3, difference  # fp16: near, never exact


def ddp_over_a_grid_group(rank, world):
    grid = torchpar.ParallelGrid(data=world, backend="gloo")  # its groups are made in C++, unknown to dist
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model, process_group=grid.data_group)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.2)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    for batch in global_batches("mlp", STEPS, world, PER_RANK):
        train_step_beside_reference(ddp, optimizer, reference, reference_optimizer, batch, rank, world)
    return ddp._data_group, max_difference(model, reference)


def test_a_group_made_in_cpp_keeps_its_own_transport():
    for data_group, difference in run_on_ranks(2, ddp_over_a_grid_group):
        assert data_group is None
        assert difference < 1e-5, difference
