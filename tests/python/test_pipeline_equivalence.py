"""The pipeline's loss and gradients equal single-process training on the same batch, for every
schedule, 2 and 4 stages, and micro-batch counts 1, stages and 2*stages+1 (where allowed)."""
import copy

import pytest
import torch
from torch import nn

from pipeline_reference import assert_matches_reference, batch, deep_mlp, reference_gradients
from rank_harness import run_on_ranks

import torchpar.pipeline


def microbatch_counts(schedule, stages):
    if schedule == "interleaved":  # micro-batches go through the virtual stages in groups of `stages`
        return [stages, 2 * stages]
    return [1, stages, 2 * stages + 1]


def train_and_compare(rank, world, schedule, virtual_stages, checkpoint):
    model = deep_mlp()
    checked, compared = [], set()
    for microbatches in microbatch_counts(schedule, world):
        inputs, target = batch(6 * microbatches, seed=microbatches)
        expected_loss, expected_grads = reference_gradients(model, inputs, target)
        pipe = torchpar.pipeline.Pipeline(
            copy.deepcopy(model), nn.functional.cross_entropy, schedule=schedule, microbatches=microbatches,
            virtual_stages=virtual_stages, checkpoint=checkpoint,
        )
        for step in range(2):  # the second step starts from accumulated-and-cleared state
            for parameter in pipe.parameters():
                parameter.grad = None
            loss = pipe.step(inputs if pipe.is_first_stage else None, target if pipe.is_last_stage else None)
            compared.update(assert_matches_reference(pipe, model, loss, expected_loss, expected_grads))
        checked.append(microbatches)
    return checked, compared


def run_and_check_coverage(world, schedule, virtual_stages, checkpoint):
    """Every rank passed, the micro-batch counts ran, and between them the ranks compared every parameter."""
    results = run_on_ranks(world, train_and_compare, schedule, virtual_stages, checkpoint, deadline_s=180)
    assert results[0][0] == microbatch_counts(schedule, world)
    compared = set().union(*(names for _, names in results))
    assert compared == {name for name, _ in deep_mlp().named_parameters()}


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_schedule_matches_single_process(schedule, stages):
    run_and_check_coverage(stages, schedule, 1, False)


@pytest.mark.parametrize("stages", [2, 4])
def test_interleaved_with_two_virtual_stages_matches_single_process(stages):
    run_and_check_coverage(stages, "interleaved", 2, False)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_activation_checkpointing_gives_equal_gradients(schedule):
    run_and_check_coverage(2, schedule, 1, True)
