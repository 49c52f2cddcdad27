"""Tensor parallelism composed: a transformer block on tensor size 2 trained for two steps against the
single-process block, and a 2 × 2 × 2 (data × pipeline × tensor) job on 8 ranks — tensor-parallel blocks
inside pipeline stages, stages averaged over data replicas — against single-process training of the
global batch."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchpar
import torchpar.pipeline
import torchpar.tensor_parallel as tp
from rank_harness import run_on_ranks
from tp_transformer import Block

WIDTH, HEADS, HIDDEN, SEQ, BATCH, LR, STEPS = 8, 4, 16, 6, 4, 0.1, 2
TOL = dict(rtol=1e-9, atol=1e-9)


def batch(step):
    generator = torch.Generator().manual_seed(50 + step)
    return torch.randn(BATCH, SEQ, WIDTH, generator=generator), torch.randn(BATCH, SEQ, WIDTH, generator=generator)


def train(model):
    """STEPS steps of SGD on the global batches; the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def reference_training(layers):
    model = nn.Sequential(*layers)
    return model, train(model)


def block_trains_like_one_process(rank, world):
    torch.set_default_dtype(torch.float64)
    group = dist.group.WORLD
    block = Block(WIDTH, HEADS, HIDDEN, group=group)
    losses = train(block)
    reference, reference_losses = reference_training([Block(WIDTH, HEADS, HIDDEN)])
    assert max(abs(a - b) for a, b in zip(losses, reference_losses)) < 1e-10, (losses, reference_losses)
    full = tp.full_state_dict(block, group)
    for name, value in reference[0].state_dict().items():
        assert torch.allclose(full[name], value, **TOL), f"{name} after {STEPS} steps"
    return losses


def test_transformer_block_on_tensor_size_2_trains_like_one_process():
    losses = run_on_ranks(2, block_trains_like_one_process)
    assert losses[0] == losses[1] and losses[0][1] < losses[0][0]


def three_d_trains_like_one_process(rank, world, backend):
    torch.set_default_dtype(torch.float64)
    grid = torchpar.ParallelGrid(data=2, pipeline=2, tensor=2, backend=backend)
    tensor = grid.tensor_group
    # Factories: each stage's ranks build only their blocks, each from its own seed (as the reference).
    layers = [lambda i=i: Block(WIDTH, HEADS, HIDDEN, group=tensor, seed=i) for i in range(4)]
    pipe = torchpar.pipeline.Pipeline(layers, F.mse_loss, schedule="1f1b", microbatches=2, balance=[2, 2],
                                      process_group=grid.pipeline_group, data_parallel_group=grid.data_group)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=LR)
    replica = slice(grid.data_index * BATCH // 2, (grid.data_index + 1) * BATCH // 2)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        losses.append(float(pipe.step(x[replica], y[replica])))
        optimizer.step()
    reference, reference_losses = reference_training([Block(WIDTH, HEADS, HIDDEN, seed=i) for i in range(4)])
    mine = range(2 * grid.pipeline_index, 2 * grid.pipeline_index + 2)
    for index, block in zip(mine, pipe.stage_modules[str(grid.pipeline_index)]):
        full = tp.full_state_dict(block, tensor)
        for name, value in reference[index].state_dict().items():
            assert torch.allclose(full[name], value, **TOL), f"block {index} {name} after {STEPS} steps"
    # The replicas' losses average to the global batch's (1e-6: the pipeline hands the loss to the other
    # stages in float32).
    both = torch.tensor(losses)
    grid.data_group.allreduce([both]).wait()
    assert torch.allclose(both / 2, torch.tensor(reference_losses), rtol=1e-6), (both / 2, reference_losses)
    return grid.data_index, grid.pipeline_index, grid.tensor_index


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_data_pipeline_tensor_2x2x2_trains_like_one_process(backend):
    coordinates = run_on_ranks(8, three_d_trains_like_one_process, backend, deadline_s=180)
    assert coordinates == [(r // 4, r // 2 % 2, r % 2) for r in range(8)]
