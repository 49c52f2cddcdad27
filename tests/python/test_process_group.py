"""Collectives over torchpar.init_process_group on real ranks, against values computed exactly."""
import pytest
import torch
import torch.distributed as dist

import torchpar
from rank_harness import child_store, run_on_ranks

LENGTH = 5


def contribution(rank: int) -> torch.Tensor:
    return torch.arange(LENGTH, dtype=torch.float64) + rank * LENGTH


def collectives(rank, world):
    total = contribution(rank)
    dist.all_reduce(total)
    assert torch.equal(total, sum(contribution(r) for r in range(world)))

    biggest = torch.full((3,), float(rank), dtype=torch.float64)
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
    assert torch.equal(biggest, torch.full((3,), world - 1.0, dtype=torch.float64))

    root = world - 1
    shared = contribution(rank) if rank == root else torch.zeros(LENGTH, dtype=torch.float64)
    dist.broadcast(shared, src=root)
    assert torch.equal(shared, contribution(root))

    gathered = [torch.zeros(LENGTH, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, contribution(rank))
    assert all(torch.equal(gathered[r], contribution(r)) for r in range(world))

    left = (rank + world - 1) % world
    incoming = torch.zeros(LENGTH, dtype=torch.float64)
    sent = dist.isend(contribution(rank), (rank + 1) % world)
    dist.recv(incoming, left)
    sent.wait()
    assert torch.equal(incoming, contribution(left))
    return dist.get_rank()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_give_exact_results(world):
    assert run_on_ranks(world, collectives) == list(range(world))


def cpp_group_matches_torch_group(rank, world):
    # The C++ torchpar::init_process_group, handed to Python as torch's own ProcessGroup type.
    group = torchpar._C.init_process_group(backend="gloo", rank=rank, world_size=world, store=child_store())
    assert isinstance(group, dist.ProcessGroup)
    assert (group.rank(), group.size()) == (rank, world)
    through_cpp = contribution(rank)
    group.allreduce([through_cpp]).wait()
    through_torch = contribution(rank)
    dist.all_reduce(through_torch)
    assert torch.equal(through_cpp, through_torch)


def test_cpp_process_group_is_a_torch_process_group():
    run_on_ranks(3, cpp_group_matches_torch_group)
