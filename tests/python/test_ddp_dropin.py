"""torchpar.DistributedDataParallel as a drop-in for torch's: a subclass of it, the same signature, pickling and
deepcopy, torch's generic Join context manager (join_hook), _set_static_graph, parameters to ignore, per-bucket
caps, init_sync, device meshes, and clear refusals of what it does not implement."""
import copy
import inspect
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

import torchpar
from ddp_reference import (
    global_batches, loss_of, make_model, max_difference, reference_step, shard, train_step_beside_reference,
)
from rank_harness import run_on_ranks

PER_RANK = 6


def test_the_signature_is_torchs_argument_for_argument():
    ours = inspect.signature(torchpar.DistributedDataParallel.__init__).parameters
    theirs = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    assert list(ours) == list(theirs)
    for name, parameter in theirs.items():
        assert ours[name].default == parameter.default, name


def positional_arguments_land_where_torchs_do(rank, world):
    model = make_model("mlp")
    # module, device_ids, output_device, dim, broadcast_buffers, init_sync, process_group, bucket_cap_mb
    group = dist.new_group(list(range(world)))
    ddp = torchpar.DistributedDataParallel(model, None, None, 0, True, True, group, 0.5)
    assert ddp.process_group is group and ddp.bucket_cap_mb == 0.5 and ddp.forward_sync_buffers
    return True


def test_positional_arguments_land_where_torchs_do():
    assert run_on_ranks(2, positional_arguments_land_where_torchs_do) == [True, True]


def a_subclass_of_torchs(rank, world):
    ddp = torchpar.DistributedDataParallel(make_model("mlp"))
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    assert not hasattr(ddp, "reducer"), "torch's constructor ran: it built a Reducer of its own"
    # What other libraries read of torch's DDP (Lightning: at teardown; torch.compile: the active module).
    assert ddp._get_ddp_logging_data()["world_size"] == world
    assert torch.nn.parallel.DistributedDataParallel._get_active_ddp_module() is None
    ddp.broadcast_buffers = False
    assert not ddp.forward_sync_buffers and not ddp.require_manual_backward_finalization
    # torch's methods on its own Reducer say so instead of an AttributeError about 'reducer'.
    for call in (lambda: ddp._register_fused_optim(torch.optim.SGD, lr=0.1), ddp._check_reducer_finalized,
                 ddp.finalize_backward):
        with pytest.raises(NotImplementedError, match="does not implement .* of torch's DistributedDataParallel"):
            call()
    return True


def test_it_is_a_torch_distributed_data_parallel_with_torchpars_engine():
    assert run_on_ranks(2, a_subclass_of_torchs) == [True, True]


def train_steps(ddp, model, reference, world, rank, steps, seed):
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in global_batches("mlp", steps, world, PER_RANK, seed=seed):
        train_step_beside_reference(ddp, optimizer, reference, reference_optimizer, batch, rank, world)
    return max_difference(model, reference)


def pickled_and_copied_models_train(rank, world):
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model, bucket_cap_mb=1e-9)
    assert train_steps(ddp, model, reference, world, rank, 2, seed=1) < 1e-5
    # torch.save / torch.load of the wrapper, as torch's DDP allows (no collective: rank 1 alone loads
    # its copy first, while rank 0 waits).
    buffer = io.BytesIO()
    torch.save(ddp, buffer)
    if rank == 1:
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert isinstance(loaded, torchpar.DistributedDataParallel) and loaded.process_group is dist.group.WORLD
    dist.barrier()
    if rank == 0:
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    for a, b in zip(loaded.module.parameters(), model.parameters()):
        assert torch.equal(a, b)
    # The loaded wrapper trains on its own parameters exactly like the original would.
    reference_of_loaded = copy.deepcopy(loaded.module)
    assert train_steps(loaded, loaded.module, reference_of_loaded, world, rank, 2, seed=2) < 1e-5
    # deepcopy gives an independent replica that trains too; the original is untouched by it.
    before = [p.detach().clone() for p in model.parameters()]
    copied = copy.deepcopy(ddp)
    assert all(a is not b for a, b in zip(copied.module.parameters(), model.parameters()))
    assert train_steps(copied, copied.module, copy.deepcopy(copied.module), world, rank, 2, seed=3) < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return True


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_a_wrapped_model_pickles_and_deep_copies_and_trains_afterwards(backend):
    assert run_on_ranks(2, pickled_and_copied_models_train, backend=backend) == [True, True]


def pickling_needs_the_default_group(rank, world):
    ddp = torchpar.DistributedDataParallel(make_model("mlp"), process_group=dist.new_group(list(range(world))))
    with pytest.raises(RuntimeError, match="only supported when using DDP with the default process group"):
        copy.deepcopy(ddp)
    return True


def test_pickling_a_model_on_another_group_is_refused_as_in_torch():
    assert run_on_ranks(2, pickling_needs_the_default_group) == [True, True]


def uneven_inputs_in_torchs_join(rank, world, divide_by_initial_world_size):
    batches_per_rank = [2 + 2 * r for r in range(world)]
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model, bucket_cap_mb=1e-9)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = global_batches("mlp", max(batches_per_rank), world, PER_RANK)
    with Join([ddp], divide_by_initial_world_size=divide_by_initial_world_size):
        for batch in batches[: batches_per_rank[rank]]:
            optimizer.zero_grad()
            inputs, targets = shard(batch, rank, world)
            loss_of(ddp(inputs), targets).backward()
            optimizer.step()
    for step, batch in enumerate(batches):
        active = [r for r in range(world) if step < batches_per_rank[r]]
        reference_optimizer.zero_grad()
        reference_step(reference, batch, world, active_ranks=active)
        if not divide_by_initial_world_size:
            for parameter in reference.parameters():
                parameter.grad *= world / len(active)
        reference_optimizer.step()
    difference = max_difference(model, reference)
    assert difference < 1e-5, f"rank {rank} differs from the reference by {difference:.3g}"
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("divide_by_initial_world_size", [True, False], ids=["initial_world", "active_ranks"])
def test_torchs_join_context_shadows_finished_ranks(divide_by_initial_world_size):
    replicas = run_on_ranks(3, uneven_inputs_in_torchs_join, divide_by_initial_world_size, backend="shm")
    for replica in replicas[1:]:
        assert all(torch.equal(a, b) for a, b in zip(replica, replicas[0]))


def early_termination(rank, world):
    ddp = torchpar.DistributedDataParallel(make_model("mlp"))
    batches = global_batches("mlp", 4, world, PER_RANK)
    with pytest.raises(RuntimeError, match="exhausted"):
        with ddp.join(throw_on_early_termination=True):
            for batch in batches[: 2 + rank]:
                inputs, targets = shard(batch, rank, world)
                loss_of(ddp(inputs), targets).backward()
    # The model keeps working afterwards, outside the context.
    inputs, targets = shard(batches[0], rank, world)
    loss_of(ddp(inputs), targets).backward()
    return True


def test_throw_on_early_termination_raises_on_every_rank():
    assert run_on_ranks(2, early_termination, backend="gloo") == [True, True]


def static_graph_after_construction(rank, world):
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model)
    ddp._set_static_graph()
    assert ddp.static_graph
    assert train_steps(ddp, model, reference, world, rank, 3, seed=1) < 1e-5
    late = torchpar.DistributedDataParallel(make_model("mlp"))
    train_steps(late, late.module, copy.deepcopy(late.module), world, rank, 1, seed=1)
    with pytest.raises(RuntimeError, match="should be called before training loop starts"):
        late._set_static_graph()
    return True


def test_set_static_graph_before_the_first_iteration_and_not_after():
    assert run_on_ranks(2, static_graph_after_construction) == [True, True]


class WithFrozenCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(12, 5)
        self.local = nn.Linear(12, 5)  # ignored: each rank keeps its own
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x):
        self.steps += 1
        return self.layer(x)


def ignored_parameters_stay_local(rank, world):
    torch.manual_seed(rank)  # different initial weights on each rank
    model = WithFrozenCounter()
    local_before = model.local.weight.detach().clone()
    torchpar.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ["local.weight", "local.bias", "steps"]
    )
    ddp = torchpar.DistributedDataParallel(model)
    assert torch.equal(model.local.weight, local_before)  # not overwritten by rank 0's
    gathered = [torch.empty_like(model.layer.weight) for _ in range(world)]
    dist.all_gather(gathered, model.layer.weight.detach())
    assert all(torch.equal(g, gathered[0]) for g in gathered)  # synchronised from rank 0
    ddp(torch.randn(4, 12)).sum().backward()
    assert model.local.weight.grad is None
    return True


def test_parameters_and_buffers_to_ignore_are_neither_synchronised_nor_reduced():
    assert run_on_ranks(2, ignored_parameters_stay_local) == [True, True]


def init_sync_off_keeps_each_ranks_values(rank, world):
    torch.manual_seed(rank)
    model = make_model("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    torchpar.DistributedDataParallel(model, init_sync=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    torch.manual_seed(rank)
    synced = make_model("mlp")
    torchpar.DistributedDataParallel(synced)
    first = next(synced.parameters()).detach()
    gathered = [torch.empty_like(first) for _ in range(world)]
    dist.all_gather(gathered, first)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def test_init_sync_false_skips_the_copy_of_rank_0s_values():
    assert run_on_ranks(2, init_sync_off_keeps_each_ranks_values) == [True, True]


def per_bucket_caps(rank, world):
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(4)])  # 1 KiB of gradient each
    kib = 1 / 1024
    ddp = torchpar.DistributedDataParallel(model, bucket_cap_mb_list=[kib, 2 * kib, 100])
    # Reverse registration order: the first bucket holds one layer, the second two, the rest the third.
    assert ddp.bucket_indices() == [[3], [2, 1], [0]]
    return True


def test_bucket_cap_mb_list_gives_each_bucket_its_cap():
    assert run_on_ranks(2, per_bucket_caps) == [True, True]


def one_dimensional_device_mesh(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    ddp = torchpar.DistributedDataParallel(make_model("mlp"), device_mesh=mesh)
    assert dist.get_world_size(ddp.process_group) == world
    with pytest.raises(RuntimeError, match="Cannot specify both process_group and device_mesh"):
        torchpar.DistributedDataParallel(make_model("mlp"), process_group=dist.group.WORLD, device_mesh=mesh)
    return True


def test_a_one_dimensional_device_mesh_gives_the_group():
    assert run_on_ranks(2, one_dimensional_device_mesh) == [True, True]


def refusals(rank, world):
    model = make_model("mlp")
    first = next(model.parameters())
    for name, value in (
        ("mixed_precision", object()),
        ("delay_all_reduce_named_params", [("0.weight", first)]),
        ("param_to_hook_all_reduce", first),
    ):
        with pytest.raises(NotImplementedError, match=f"does not implement {name}"):
            torchpar.DistributedDataParallel(model, **{name: value})
    with pytest.raises(ValueError, match="device_ids and output_device arguments only work with single-device GPU"):
        torchpar.DistributedDataParallel(model, device_ids=[0])
    with pytest.raises(RuntimeError, match="doesn't have any parameter that requires a gradient"):
        torchpar.DistributedDataParallel(nn.Linear(2, 2).requires_grad_(False))
    return True


def test_what_it_does_not_implement_is_refused_with_the_argument_named():
    assert run_on_ranks(2, refusals) == [True, True]
