"""Tensor parallelism's checks and the loss's options, from one 2-rank launch: ranks that drew different
initial values for a layer are refused naming the layer and the fix; a collective inside a layer that meets a
sequence not divisible by the tensor size names the layer; vocab_parallel_cross_entropy with ignore_index,
label_smoothing and each reduction equals F.cross_entropy on the full logits, loss and logits' gradient
(float64, 1e-10)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchpar.tensor_parallel as tp
from rank_harness import run_on_ranks

IN, HIDDEN, OUT, VOCAB, SEQ, BATCH = 8, 12, 6, 24, 6, 4
TOL = dict(rtol=1e-10, atol=1e-10)
# (options, which targets are set to the ignored id)
LOSS_CASES = [
    (dict(), None),
    (dict(label_smoothing=0.1), None),
    (dict(ignore_index=5), "some"),  # an ignored id inside the vocabulary (rank 0's slice)
    (dict(ignore_index=17, label_smoothing=0.2), "some"),  # ... and in rank 1's
    (dict(ignore_index=-1, label_smoothing=1.0), "some"),
    (dict(label_smoothing=0.3), "all"),  # the mean over no position: NaN, gradient 0
]
REDUCTIONS = ("none", "mean", "sum")


def first_line(call):
    try:
        call()
    except RuntimeError as error:
        return str(error).split("\n")[0]
    return "no error"


def loss_mismatches(rank, world):
    """Every (case, reduction) whose loss or logits' gradient differs from F.cross_entropy's."""
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(SEQ, BATCH, VOCAB, generator=generator) * 3
    mismatches = []
    for options, ignored in LOSS_CASES:
        targets = torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator)
        ignore_index = options.get("ignore_index", -100)
        if ignored == "some":
            targets[::2, 1:] = ignore_index
        elif ignored == "all":
            targets.fill_(ignore_index)
        for reduction in REDUCTIONS:
            what = f"{options}, {ignored} ignored, reduction={reduction}"
            # Per-position weights on the gradient with reduction='none', so each position's scale is checked.
            weights = torch.rand(SEQ, BATCH, generator=generator) if reduction == "none" else None
            full = logits.clone().requires_grad_()
            expected = F.cross_entropy(full.reshape(-1, VOCAB), targets.reshape(-1), reduction=reduction, **options)
            expected = expected.reshape(SEQ, BATCH) if reduction == "none" else expected
            (expected * weights).sum().backward() if weights is not None else expected.backward()
            mine = logits.chunk(world, -1)[rank].clone().requires_grad_()
            loss = tp.vocab_parallel_cross_entropy(mine, targets, group, reduction=reduction, **options)
            (loss * weights).sum().backward() if weights is not None else loss.backward()
            if loss.shape != expected.shape or not torch.allclose(loss, expected, equal_nan=True, **TOL):
                mismatches.append(f"loss, {what}: {loss} against {expected}")
            if not torch.allclose(mine.grad, full.grad.chunk(world, -1)[rank], **TOL):
                mismatches.append(f"gradient, {what}: largest difference "
                                  f"{(mine.grad - full.grad.chunk(world, -1)[rank]).abs().max()}")
    return mismatches


def checks(rank, world):
    torch.set_default_dtype(torch.float64)
    group = dist.group.WORLD
    messages = {}
    # A seed per rank: every layer's full initial values differ across the group.
    for kind, build in (("column", lambda: tp.ColumnParallelLinear(IN, HIDDEN, group=group, name="blocks.0.up")),
                        ("row", lambda: tp.RowParallelLinear(HIDDEN, OUT, group=group, name="blocks.0.down")),
                        ("embedding", lambda: tp.VocabParallelEmbedding(VOCAB, IN, group=group, name="wte"))):
        torch.manual_seed(rank)
        messages[kind] = first_line(build)
    # The same seed, but one rank drew once more before building.
    torch.manual_seed(0)
    if rank == 1:
        torch.rand(1)
    messages["drawn"] = first_line(lambda: tp.RowParallelLinear(HIDDEN, OUT, bias=False, group=group,
                                                                name="blocks.1.down"))

    # Sequence parallelism with a sequence of 5 positions on 2 ranks.
    torch.manual_seed(0)
    down = tp.RowParallelLinear(HIDDEN, OUT, group=group, sequence_parallel=True, name="blocks.2.down")
    embedding = tp.VocabParallelEmbedding(VOCAB, IN, group=group, sequence_parallel=True, name="wte")
    messages["row sequence"] = first_line(lambda: down(torch.zeros(5, BATCH, HIDDEN // world)))
    messages["embedding sequence"] = first_line(lambda: embedding(torch.zeros(5, BATCH, dtype=torch.long)))
    messages["mapping sequence"] = first_line(lambda: tp.scatter_to_sequence_parallel(torch.zeros(5, BATCH), group))
    # ... and the layers still work on a sequence that divides.
    assert down(torch.zeros(6, BATCH, HIDDEN // world)).shape == (6 // world, BATCH, OUT)

    messages["smoothing"] = first_line(lambda: tp.vocab_parallel_cross_entropy(
        torch.zeros(2, VOCAB // world), torch.tensor([1, 2]), group, label_smoothing=1.5))
    messages["reduction"] = first_line(lambda: tp.vocab_parallel_cross_entropy(
        torch.zeros(2, VOCAB // world), torch.tensor([1, 2]), group, reduction="avg"))
    messages["ignored out of range"] = first_line(lambda: tp.vocab_parallel_cross_entropy(
        torch.zeros(2, VOCAB // world), torch.tensor([1, VOCAB]), group, ignore_index=-1))
    return messages, loss_mismatches(rank, world)


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(2, checks)


@pytest.mark.parametrize("kind,name,tensors", [("column", "blocks.0.up", "weight, bias"),
                                               ("row", "blocks.0.down", "weight, bias"),
                                               ("embedding", "wte", "weight"),
                                               ("drawn", "blocks.1.down", "weight")])
def test_ranks_seeded_differently_are_refused_naming_the_layer_and_the_fix(results, kind, name, tensors):
    for messages, _ in results:  # every rank refuses, so none is left waiting in a collective
        assert messages[kind] == (
            f"{name}: the ranks of the tensor-parallel group built different initial values of the layer "
            f"({tensors}): rank 1 drew other values than rank 0, so their shards are not one layer; seed every "
            "rank the same before building the layer (torch.manual_seed(0) in Python, torch::manual_seed(0) in "
            "C++), with the same random draws before it")


def test_a_sequence_that_does_not_divide_names_the_layer(results):
    for messages, _ in results:
        assert messages["row sequence"] == (
            "blocks.2.down: reduce_scatter_to_sequence_parallel: dimension 0 of a tensor of shape [5, 4, 6] does "
            "not divide by the tensor-parallel size 2; make it a multiple of 2")
        assert messages["embedding sequence"].startswith(
            "wte: reduce_scatter_to_sequence_parallel: dimension 0 of a tensor of shape [5, 4, 8] does not divide")
        # Called directly, the mapping names itself.
        assert messages["mapping sequence"].startswith("scatter_to_sequence_parallel: dimension 0 of a tensor")


def test_loss_options_are_refused_with_the_valid_values(results):
    messages = results[0][0]
    assert messages["smoothing"] == ("vocab_parallel_cross_entropy: label_smoothing must be between 0.0 and 1.0, "
                                     "got 1.5")
    assert messages["reduction"] == ("vocab_parallel_cross_entropy: reduction 'avg' is not one of 'none', 'mean', "
                                     "'sum'")
    assert messages["ignored out of range"] == ("vocab_parallel_cross_entropy: target 24 is out of range [0, 24) "
                                                "of the vocabulary")


def test_loss_equals_f_cross_entropy_with_every_option(results):
    for rank, (_, mismatches) in enumerate(results):
        assert mismatches == [], f"rank {rank}:\n" + "\n".join(mismatches)
