"""torch's FSDP2 (fully_shard) on torchpar's shm backend, fp32 and bf16 mixed precision, against one process."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rank_harness import run_on_ranks

STEPS, BATCH_PER_RANK = 3, 4


def network() -> nn.Sequential:
    torch.manual_seed(0)
    # 7 and 13 do not divide by 2 or 3 ranks: FSDP2 pads the shards.
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 13), nn.GELU(), nn.Linear(13, 3))


def batches(world: int):
    generator = torch.Generator().manual_seed(5)
    return [(torch.randn(world * BATCH_PER_RANK, 7, generator=generator),
             torch.randint(0, 3, (world * BATCH_PER_RANK,), generator=generator)) for _ in range(STEPS)]


def train(model: nn.Module, steps, rank_slice) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in steps:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[rank_slice]).float(), y[rank_slice]).backward()
        optimizer.step()


def sharded_training(rank, world, precision):
    shm = dist.new_group(backend="shm")
    mesh = dist.device_mesh.DeviceMesh.from_group(shm, "cpu")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    model = network()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    train(model, batches(world), slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK))
    return {name: parameter.full_tensor().detach() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fully_shard_on_shm_matches_one_process(precision):
    world = 2
    reference = network()
    if precision == "bf16":
        # One process with the policy's arithmetic: bf16 compute on bf16 copies of fp32 master weights.
        reference_bf16 = network().to(torch.bfloat16)
        optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
        for x, y in batches(world):
            with torch.no_grad():
                for low, master in zip(reference_bf16.parameters(), reference.parameters()):
                    low.copy_(master)
                    low.grad = None
            nn.functional.cross_entropy(reference_bf16(x.to(torch.bfloat16)).float(), y).backward()
            optimizer.zero_grad()
            for low, master in zip(reference_bf16.parameters(), reference.parameters()):
                master.grad = low.grad.float()
            optimizer.step()
        tolerance = dict(rtol=0, atol=3e-2)  # a bf16 gradient per rank, averaged, against one of the whole batch
    else:
        train(reference, batches(world), slice(None))
        tolerance = dict(rtol=1e-5, atol=1e-6)
    results = run_on_ranks(world, sharded_training, precision, backend="gloo", deadline_s=180)
    for rank, parameters in enumerate(results):
        for name, expected in reference.named_parameters():
            torch.testing.assert_close(parameters[name].float(), expected.detach(), **tolerance,
                                       msg=lambda m: f"rank {rank} {precision} {name}: {m}")
