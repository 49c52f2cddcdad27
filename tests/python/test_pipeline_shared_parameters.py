"""Tied parameters across pipeline stages (an embedding whose matrix is also the output layer's, as in
GPT-2): found or declared, the copies on the ranks holding them start equal, get the sum of their
gradients every step and stay equal; after two optimizer steps they equal single-process training, for
every schedule, with data parallelism too. A tie whose copies cannot be one parameter is refused."""
import copy

import torch
import torch.distributed as dist
from torch import nn

from pipeline_reference import own_layers
from rank_harness import run_on_ranks

import torchpar.pipeline

VOCAB, WIDTH, LR = 11, 8, 0.1
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2)]


class TiedHead(nn.Module):
    """The output layer: logits against the embedding's own matrix (the same Parameter object)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight = embedding.weight

    def forward(self, hidden):
        return hidden @ self.weight.t()


def tied_model() -> nn.Sequential:
    """8 layers: 2 stages of 4, or 2 ranks x 2 virtual stages of 2 (the tie between stages 0 and 3)."""
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, WIDTH)
    return nn.Sequential(embedding, nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.Tanh(), TiedHead(embedding))


def token_batch(size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (size,), generator=generator),
            torch.randint(0, VOCAB, (size,), generator=generator))


def reference_training(model: nn.Module, batches):
    """Losses and the model after one SGD step (momentum: the optimizer's state matters) per batch, in one process."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for inputs, target in batches:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


def train(pipe, batches, replica_slice=slice(None)):
    optimizer = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    losses = []
    for inputs, target in batches:
        optimizer.zero_grad()
        inputs, target = inputs[replica_slice], target[replica_slice]
        loss = pipe.step(inputs if pipe.is_first_stage else None, target if pipe.is_last_stage else None)
        optimizer.step()
        losses.append(loss.item())
    return losses


def check_tied_copies(pipe, reference, group=None):
    """Every copy of the embedding matrix equals the reference's, and the ranks' copies are one."""
    local = [module.weight for stage in pipe.stage_modules.values() for module in stage
             if isinstance(module, (nn.Embedding, TiedHead))]
    held = torch.zeros(VOCAB, WIDTH) if not local else local[0].detach()
    for weight in local:
        assert torch.equal(weight, held), "the copies on one rank differ"
        difference = (weight - reference[0].weight).abs().max().item()
        assert difference <= 1e-5, f"tied weight differs from single-process training by {difference:.3g}"
    copies = [torch.zeros(VOCAB, WIDTH) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, held.contiguous(), group=group)
    holders = [c for c in copies if c.abs().sum() > 0]
    assert len(holders) >= 2 and all(torch.equal(c, holders[0]) for c in holders), "the ranks' copies differ"


def check_other_parameters(pipe, reference):
    for layer in own_layers(pipe):
        for name, parameter in pipe._built[layer].named_parameters():
            expected = dict(reference[layer].named_parameters())[name]
            difference = (parameter - expected).abs().max().item()
            assert difference <= 1e-5, f"layer {layer} {name} differs from single-process training by {difference:.3g}"


def every_schedule_with_a_tie(rank, world):
    model = tied_model()
    batches = [token_batch(8, seed) for seed in (1, 2)]
    expected_losses, reference = reference_training(model, batches)
    reports = {}
    for schedule, virtual_stages in SCHEDULES:
        local = copy.deepcopy(model)  # keeps the tie: one Parameter in layers 0 and 7
        if rank == 1:  # this rank's copy starts elsewhere; the pipeline starts it from layer 0's rank
            with torch.no_grad():
                local[7].weight.add_(1.0)
        pipe = torchpar.pipeline.Pipeline(local, nn.functional.cross_entropy, schedule=schedule, microbatches=4,
                                          virtual_stages=virtual_stages)
        assert pipe.shared_parameters == [[(0, "weight"), (7, "weight")]], pipe.shared_parameters
        distinct = {id(p) for layer in own_layers(pipe) for p in pipe._built[layer].parameters()}
        assert len(pipe.parameters()) == len(distinct), "a tied parameter is listed twice"
        losses = train(pipe, batches)
        for got, expected in zip(losses, expected_losses):
            assert abs(got - expected) <= 1e-5, (schedule, losses, expected_losses)
        check_tied_copies(pipe, reference)
        check_other_parameters(pipe, reference)
        reports[schedule] = pipe.shared_parameters_report
    return reports


def test_tied_embedding_and_head_equal_single_process_for_every_schedule():
    reports = run_on_ranks(2, every_schedule_with_a_tie, deadline_s=180)
    assert "layer 0 'weight' = layer 7 'weight': stages 0, 1 on ranks 0, 1" in reports[0]["1f1b"], reports[0]
    assert "stages 0, 3 on ranks 0, 1" in reports[0]["interleaved"], reports[0]


def tie_with_data_parallel(rank, world):
    """2 replicas of 2 stages, then one pipeline of 4 stages."""
    pipeline_group, data_parallel_group = torchpar.pipeline.hybrid_groups(stages=2)
    model = tied_model()
    batches = [token_batch(8, seed) for seed in (1, 2)]
    _, reference = reference_training(model, batches)
    replica = rank // 2
    for schedule in ("1f1b", "zero_bubble"):
        local = copy.deepcopy(model)
        if replica == 1:  # replica 1 starts elsewhere: every copy starts from replica 0's layer 0
            with torch.no_grad():
                for parameter in local.parameters():
                    parameter.add_(1.0)
        pipe = torchpar.pipeline.Pipeline(local, nn.functional.cross_entropy, schedule=schedule, microbatches=2,
                                          process_group=pipeline_group, data_parallel_group=data_parallel_group)
        train(pipe, batches, slice(4 * replica, 4 * replica + 4))
        check_tied_copies(pipe, reference)
        check_other_parameters(pipe, reference)
    # One pipeline of 4 stages: the copies on ranks 0 and 3 sum their gradients in a group of their own.
    pipe = torchpar.pipeline.Pipeline(copy.deepcopy(model), nn.functional.cross_entropy, microbatches=4)
    train(pipe, batches)
    check_tied_copies(pipe, reference)
    check_other_parameters(pipe, reference)
    return pipe.shared_parameters_report


def test_tie_with_pipeline_x_data_parallel_and_between_two_of_four_ranks():
    report = run_on_ranks(4, tie_with_data_parallel, deadline_s=240)[0]
    assert "stages 0, 3 on ranks 0, 3, gradients summed over them" in report, report


def refusals(rank, world):
    """The messages with which ties that cannot be one parameter are refused, on this rank."""
    messages = []
    # Declared across ranks between tensors of different shapes: the embedding [11, 8], a Linear's [5, 8].
    factories = [lambda: nn.Embedding(VOCAB, WIDTH), lambda: nn.Linear(WIDTH, WIDTH), lambda: nn.Tanh(),
                 lambda: nn.Linear(WIDTH, 5)]
    for shared in ([[(0, "weight"), (3, "weight")]], [["0.weight", "3.wieght"]]):
        try:
            torchpar.pipeline.Pipeline(factories, nn.functional.cross_entropy, microbatches=2,
                                       shared_parameters=shared)
            messages.append(None)
        except RuntimeError as error:
            messages.append(str(error))
    return messages


def test_ties_that_cannot_hold_are_refused_on_every_rank():
    results = run_on_ranks(2, refusals, deadline_s=60)
    for rank, (shapes, name) in enumerate(results):
        assert shapes is not None and "the tied parameters layer 0 'weight' = layer 3 'weight' differ across the " \
            "pipeline ranks holding them: rank 0 has [11, 8] Float, rank 1 has [5, 8] Float" in shapes, shapes
        assert name is not None, f"rank {rank} accepted a tie to a parameter that does not exist"
    assert "layer 3 'wieght' does not exist: layer 3 (3) has parameters 'weight', 'bias'" in results[1][1], results[1][1]
    assert "pipeline rank(s) 1 could not find their copies" in results[0][1], results[0][1]
