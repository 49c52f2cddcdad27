"""Tensor parallelism against single-process layers: every layer and the vocabulary-parallel loss on
tensor sizes 1-4, forward output, input gradient and every weight gradient (each rank's shard against the
matching slice of the single-process gradient), with and without sequence parallelism; the 3-D grid's
coordinates and groups; and the errors. float64, so the only differences are summation order (1e-10)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchpar
import torchpar.tensor_parallel as tp
from rank_harness import run_on_ranks

IN, HIDDEN, OUT, VOCAB, SEQ, BATCH = 8, 12, 6, 24, 12, 2  # HIDDEN, VOCAB and SEQ divide by 1, 2, 3 and 4
TOL = dict(rtol=1e-10, atol=1e-10)


def shard(tensor, dim, rank, size):
    return tensor.chunk(size, dim)[rank]


def close(actual, expected, what):
    assert torch.allclose(actual, expected, **TOL), f"{what}: largest difference {(actual - expected).abs().max()}"


def layers_equal_single_process(rank, world, backend):
    torch.set_default_dtype(torch.float64)
    group = dist.group.WORLD
    # The same seed everywhere: the tensor-parallel layers and the single-process ones start equal.
    torch.manual_seed(0)
    up = tp.ColumnParallelLinear(IN, HIDDEN, group=group)
    down = tp.RowParallelLinear(HIDDEN, OUT, group=group)
    embedding = tp.VocabParallelEmbedding(VOCAB, IN, group=group)
    head = tp.ColumnParallelLinear(IN, VOCAB, bias=False, group=group)
    torch.manual_seed(0)
    up_ref, down_ref = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)
    embedding_ref, head_ref = nn.Embedding(VOCAB, IN), nn.Linear(IN, VOCAB, bias=False)
    close(up.weight, shard(up_ref.weight, 0, rank, world), "column shard at init")
    close(down.weight, shard(down_ref.weight, 1, rank, world), "row shard at init")
    close(embedding.weight, shard(embedding_ref.weight, 0, rank, world), "vocabulary shard at init")

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SEQ, BATCH, IN, generator=generator)
    ids = torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator)
    targets = torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator)

    # LayerNorm before the MLP: replicated without sequence parallelism, its gradient summed over the
    # ranks' positions with it.
    norms = {False: nn.LayerNorm(IN), True: tp.SequenceParallelLayerNorm(IN, group=group)}
    norm_ref = nn.LayerNorm(IN)
    for norm in (*norms.values(), norm_ref):
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 1.5, IN))
            norm.bias.copy_(torch.linspace(-0.2, 0.2, IN))

    for sequence_parallel in (False, True):
        norm = norms[sequence_parallel]
        for module in (up, down, embedding, head, norm):
            module.sequence_parallel = sequence_parallel
            for p in module.parameters():
                p.grad = None
        for module in (up_ref, down_ref, embedding_ref, head_ref, norm_ref):
            module.zero_grad(set_to_none=True)
        what = f"sequence_parallel={sequence_parallel}"

        # LayerNorm -> column -> GELU -> row, and the reference.
        x_ref = x.clone().requires_grad_()
        y_ref = down_ref(F.gelu(up_ref(norm_ref(x_ref))))
        (y_ref * torch.arange(OUT)).sum().backward()
        x_mine = (shard(x, 0, rank, world) if sequence_parallel else x).clone().requires_grad_()
        y = down(F.gelu(up(norm(x_mine))))
        close(y, shard(y_ref, 0, rank, world) if sequence_parallel else y_ref, f"MLP output, {what}")
        (y * torch.arange(OUT)).sum().backward()
        close(x_mine.grad, shard(x_ref.grad, 0, rank, world) if sequence_parallel else x_ref.grad,
              f"MLP input gradient, {what}")
        close(up.weight.grad, shard(up_ref.weight.grad, 0, rank, world), f"column weight gradient, {what}")
        close(up.bias.grad, shard(up_ref.bias.grad, 0, rank, world), f"column bias gradient, {what}")
        close(down.weight.grad, shard(down_ref.weight.grad, 1, rank, world), f"row weight gradient, {what}")
        close(down.bias.grad, down_ref.bias.grad, f"row bias gradient, {what}")
        close(norm.weight.grad, norm_ref.weight.grad, f"LayerNorm weight gradient, {what}")
        close(norm.bias.grad, norm_ref.bias.grad, f"LayerNorm bias gradient, {what}")

        # Embedding -> vocabulary-parallel head -> vocabulary-parallel loss.
        hidden_ref = embedding_ref(ids)
        losses_ref = F.cross_entropy(head_ref(hidden_ref).reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
        losses_ref.mean().backward()
        hidden = embedding(ids)  # with sequence parallelism: this rank's positions, all-gathered by the head
        close(hidden, shard(hidden_ref, 0, rank, world) if sequence_parallel else hidden_ref,
              f"embedding output, {what}")
        losses = tp.vocab_parallel_cross_entropy(head(hidden), targets, group, reduction="none")
        close(losses.reshape(-1), losses_ref, f"vocabulary-parallel loss, {what}")
        losses.mean().backward()
        close(head.weight.grad, shard(head_ref.weight.grad, 0, rank, world), f"head weight gradient, {what}")
        close(embedding.weight.grad, shard(embedding_ref.weight.grad, 0, rank, world),
              f"embedding weight gradient, {what}")

    # gather_output: every rank gets the whole output.
    gathered = tp.ColumnParallelLinear(IN, HIDDEN, group=group, gather_output=True)
    gathered.weight.data.copy_(shard(up_ref.weight, 0, rank, world))
    gathered.bias.data.copy_(shard(up_ref.bias, 0, rank, world))
    close(gathered(x), up_ref(x), "gather_output")
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layers_and_loss_equal_single_process(world):
    assert run_on_ranks(world, layers_equal_single_process, "gloo") == [True] * world


def test_layers_on_shm():
    assert run_on_ranks(2, layers_equal_single_process, "shm", backend="shm") == [True] * 2


def grid_coordinates_and_groups(rank, world, sizes):
    data, pipeline, tensor = sizes
    grid = torchpar.ParallelGrid(data, pipeline, tensor)
    assert (grid.data_size, grid.pipeline_size, grid.tensor_size) == sizes
    assert grid.rank_of(grid.data_index, grid.pipeline_index, grid.tensor_index) == rank
    assert rank == (grid.data_index * pipeline + grid.pipeline_index) * tensor + grid.tensor_index
    members = {}
    for axis in ("data", "pipeline", "tensor"):
        group = getattr(grid, f"{axis}_group")
        # Each group holds exactly the ranks that differ from this one along its axis only.
        mine = torch.zeros(world)
        mine[rank] = 1
        group.allreduce([mine]).wait()
        members[axis] = mine.nonzero().flatten().tolist()
    return members, repr(grid)


def test_parallel_grid_puts_tensor_groups_innermost():
    results = run_on_ranks(4, grid_coordinates_and_groups, (1, 2, 2))
    assert [r[0]["tensor"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[0]["pipeline"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r[0]["data"] for r in results] == [[0], [1], [2], [3]]
    assert results[3][1] == "ParallelGrid(rank 3 of 4: data 0/1, pipeline 1/2, tensor 1/2)"
    results = run_on_ranks(4, grid_coordinates_and_groups, (2, 1, 2))
    assert [r[0]["data"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def errors(rank, world):
    group = dist.group.WORLD
    messages = []

    def refused(fn):
        try:
            fn()
        except RuntimeError as error:
            messages.append(str(error).split("\n")[0])
        else:
            messages.append("no error")

    refused(lambda: tp.ColumnParallelLinear(8, 7, group=group, name="blocks.0.up"))
    refused(lambda: tp.RowParallelLinear(5, 4, group=group, name="blocks.0.down"))
    refused(lambda: tp.ColumnParallelLinear(8 + 2 * rank, 6, group=group, name="blocks.1.up"))
    embedding = tp.VocabParallelEmbedding(10, 4, group=group, name="wte")
    refused(lambda: embedding(torch.tensor([3, 10])))
    refused(lambda: tp.vocab_parallel_cross_entropy(torch.zeros(2, 5), torch.tensor([1, 10]), group))
    up = tp.ColumnParallelLinear(8, 6, group=group, name="blocks.2.up")
    refused(lambda: up(torch.zeros(3, 7)))
    refused(lambda: torchpar.ParallelGrid(2, 2, 2))
    return messages


def test_errors_name_the_layer_the_sizes_and_the_fix():
    messages = run_on_ranks(2, errors)[1]
    assert messages[0] == ("blocks.0.up: out_features 7 does not divide by the tensor-parallel size 2; choose "
                           "out_features that is a multiple of 2 (or another tensor-parallel size)")
    assert messages[1].startswith("blocks.0.down: in_features 5 does not divide by the tensor-parallel size 2")
    assert messages[2] == ("blocks.1.up: the ranks of the tensor-parallel group built different layers "
                           "(in_features, out_features, bias): rank 0 [8, 6, 1], rank 1 [10, 6, 1]; every rank of "
                           "the group must build the same layer")
    assert messages[3] == "wte: id 10 is out of range [0, 10) of the vocabulary"
    assert messages[4] == "vocab_parallel_cross_entropy: target 10 is out of range [0, 10) of the vocabulary"
    assert messages[5] == "blocks.2.up: input of shape [3, 7] does not end in in_features 8"
    assert messages[6] == ("ParallelGrid: data 2 × pipeline 2 × tensor 2 = 8 ranks, but the process group has 2; "
                           "choose sizes whose product is 2")


def clipping_state_dict_and_randomness(rank, world):
    torch.set_default_dtype(torch.float64)
    group = dist.group.WORLD
    torch.manual_seed(0)
    model = nn.Sequential(tp.ColumnParallelLinear(IN, HIDDEN, group=group), nn.LayerNorm(HIDDEN // world),
                          tp.RowParallelLinear(HIDDEN, OUT, group=group))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT))

    # The full state_dict gathers the shards into the single-process layers' tensors.
    full = tp.full_state_dict(model, group)
    close(full["0.weight"], reference[0].weight, "gathered column weight")
    close(full["2.weight"], reference[1].weight, "gathered row weight")
    close(full["2.bias"], reference[1].bias, "row bias")
    # ... and loading it back (after scribbling) restores every shard.
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7)
    tp.load_full_state_dict(model, full, group)
    close(model[0].weight, shard(reference[0].weight, 0, rank, world), "reloaded column shard")
    close(model[2].weight, shard(reference[1].weight, 1, rank, world), "reloaded row shard")

    # Gradient clipping sees the whole model's norm: shards summed, the replicated LayerNorm and row bias
    # counted once. Gradients set by hand: 1 on the shards, 2 on replicated parameters.
    for name, p, dim in tp.parameter_layouts(model):
        p.grad = torch.full_like(p, 1.0 if dim >= 0 else 2.0)
    sharded = sum(p.numel() for _, p, dim in tp.parameter_layouts(model) if dim >= 0) * world
    replicated = sum(p.numel() for _, p, dim in tp.parameter_layouts(model) if dim < 0)
    expected = (sharded * 1.0 + replicated * 4.0) ** 0.5
    norm = tp.clip_grad_norm_(model, max_norm=1.0, tensor_group=group)
    assert abs(norm - expected) < 1e-9, (norm, expected)
    assert abs(model[0].weight.grad[0, 0].item() - 1.0 / (expected + 1e-6)) < 1e-12

    # Dropout: the default stream is equal on every rank, the split stream differs per rank and both are
    # reproducible.
    random = tp.TensorParallelRandom(1234, group)
    replicated_mask = torch.rand(16)
    with random.fork():
        split_mask = torch.rand(16)
    after = torch.rand(16)  # the default stream continues as if the fork had not drawn
    random = tp.TensorParallelRandom(1234, group)
    again = torch.rand(16)
    with random.fork():
        split_again = torch.rand(16)
    close(again, replicated_mask, "default stream reproducible")
    close(split_again, split_mask, "split stream reproducible")
    with random.fork():
        split_next = torch.rand(16)  # the split stream continues where it stopped
    everyone = [torch.empty(2, 16) for _ in range(world)]
    dist.all_gather(everyone, torch.stack([replicated_mask, split_mask]), group=group)
    return torch.stack(everyone), after, split_next


def test_clipping_state_dict_and_dropout_streams():
    results = run_on_ranks(2, clipping_state_dict_and_randomness)
    gathered = results[0][0]  # [rank, stream, 16] as every rank drew them
    close(gathered[0, 0], gathered[1, 0], "the default stream is equal across the tensor group")
    assert not torch.allclose(gathered[0, 1], gathered[1, 1]), "the split stream must differ between ranks"
    torch.manual_seed(1234)
    _, second = torch.rand(16, dtype=torch.float64), torch.rand(16, dtype=torch.float64)
    close(results[0][1], second, "the default stream continues past the fork")
    assert not torch.allclose(results[0][2], gathered[0, 1]), "the split stream continues, not restarts"
