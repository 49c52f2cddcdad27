"""DDP on an shm data group averages the gradients where autograd left them (one allreduce_coalesced of
a bucket's gradients, no copy into the bucket and back): the gradients it cannot take so (strided,
requiring grad, kept from before for a parameter unused now) go through the bucket as before, and
training equals single-process training either way."""
import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchpar
from rank_harness import run_on_ranks

PER_RANK = 4
STEPS = 3


class Mixed(nn.Module):
    """A channels_last convolution (its weight's gradient is not contiguous), a linear head, and a
    branch no forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.head = nn.Linear(4 * 6 * 6, 5)
        self.unused = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x.contiguous(memory_format=torch.channels_last))).flatten(1))


def used_parameters(model: Mixed) -> list[nn.Parameter]:
    return [*model.conv.parameters(), *model.head.parameters()]


def train_against_reference(rank, world, create_graph):
    torch.manual_seed(0)
    model = Mixed()
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=1000.0)
    assert ddp._coordinator.gradients_reduced_in_place
    # A gradient kept from before, different on every rank: no rank uses the parameter, so it must stay.
    stale = torch.full_like(model.unused.weight, 7.0 + rank)
    model.unused.weight.grad = stale.clone()
    optimizer = torch.optim.SGD(used_parameters(model), lr=0.1)
    reference_optimizer = torch.optim.SGD(used_parameters(reference), lr=0.1)
    generator = torch.Generator().manual_seed(3)
    head_gradient = None
    for _ in range(STEPS):
        x = torch.randn(world * PER_RANK, 3, 8, 8, generator=generator)
        y = torch.randint(0, 5, (world * PER_RANK,), generator=generator)
        optimizer.zero_grad(set_to_none=False)
        reference_optimizer.zero_grad(set_to_none=False)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        nn.functional.cross_entropy(ddp(x[mine]), y[mine]).backward(create_graph=create_graph)
        nn.functional.cross_entropy(reference(x), y).backward(create_graph=create_graph)
        if head_gradient is not None and not create_graph:  # create_graph: autograd itself makes new ones
            assert model.head.weight.grad is head_gradient, "the gradient tensor was replaced, not updated"
        head_gradient = model.head.weight.grad
        for name, ours, theirs in zip(("conv.weight", "conv.bias", "head.weight", "head.bias"),
                                      used_parameters(model), used_parameters(reference)):
            assert torch.allclose(ours.grad, theirs.grad, atol=1e-6), (
                f"{name}: gradient differs from single-process training by {(ours.grad - theirs.grad).abs().max():.3g}")
        with torch.no_grad():
            optimizer.step()
            reference_optimizer.step()
    assert not model.conv.weight.grad.is_contiguous()  # the strided gradient really went through the bucket
    assert torch.equal(model.unused.weight.grad, stale), "a gradient of a parameter no rank used was changed"
    return [p.detach() for p in used_parameters(model)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("create_graph", [False, True], ids=["backward", "create_graph"])
def test_gradients_averaged_where_they_lie_equal_single_process_training(world, create_graph):
    replicas = run_on_ranks(world, train_against_reference, create_graph, backend="shm")
    for replica in replicas[1:]:
        for ours, first in zip(replica, replicas[0]):
            assert torch.equal(ours, first)


def which_reduce_in_place(rank, world):
    os.environ["TORCHPAR_DDP_SAME_HOST"] = "1"
    on_gloo_via_shm = torchpar.DistributedDataParallel(nn.Linear(4, 4))
    as_view = torchpar.DistributedDataParallel(nn.Linear(4, 4), gradient_as_bucket_view=True)
    hooked = torchpar.DistributedDataParallel(nn.Linear(4, 4))
    hooked.register_comm_hook(None, torchpar.ddp.allreduce_hook)
    os.environ["TORCHPAR_DDP_SAME_HOST"] = "0"
    on_gloo = torchpar.DistributedDataParallel(nn.Linear(4, 4))
    dist.barrier()
    return [ddp._coordinator.gradients_reduced_in_place for ddp in (on_gloo_via_shm, as_view, hooked, on_gloo)]


def test_in_place_on_an_shm_data_group_only_without_bucket_views_or_hooks():
    assert run_on_ranks(2, which_reduce_in_place, backend="gloo") == [[True, False, False, False]] * 2
