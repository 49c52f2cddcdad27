"""The pipeline's errors: each names the stage, micro-batch and shapes, and none hangs."""
import os
import time

import torch
from torch import nn

from pipeline_reference import batch, deep_mlp
from rank_harness import launch_ranks, run_on_ranks

import torchpar.pipeline


def step_indivisible_batch(rank, world):
    pipe = torchpar.pipeline.Pipeline(deep_mlp(), nn.functional.cross_entropy, microbatches=4)
    inputs, target = batch(10)
    try:
        pipe.step(inputs, target)
    except RuntimeError as error:
        return str(error)
    raise AssertionError("a batch of 10 was split into 4 micro-batches without an error")


def test_batch_not_divisible_into_microbatches():
    for message in run_on_ranks(2, step_indivisible_batch, deadline_s=60):
        assert "batch of 10 samples" in message and "does not split into 4 equal micro-batches" in message, message


def construction_error(rank, world, layers, options):
    """The message with which Pipeline(layers, ..., **options) is refused on this rank."""
    try:
        torchpar.pipeline.Pipeline(layers, nn.functional.cross_entropy, **options)
    except RuntimeError as error:
        return str(error)
    raise AssertionError(f"a pipeline was built with {options}")


def test_microbatches_the_schedule_cannot_run():
    options = dict(schedule="interleaved", microbatches=3, virtual_stages=2)
    for message in run_on_ranks(2, construction_error, deep_mlp(), options, deadline_s=60):
        assert "micro-batches (3) must be a multiple of the pipeline ranks (2)" in message, message


def test_more_stages_than_layers():
    for message in run_on_ranks(2, construction_error, [nn.Linear(12, 5)], dict(microbatches=2), deadline_s=60):
        assert "1 layers cannot fill 2 stages" in message, message


def mismatched_pipeline():
    torch.manual_seed(0)
    # Stage 0 ends with 16 features; stage 1 starts with a layer expecting 12.
    layers = [nn.Linear(12, 16), nn.Tanh(), nn.Linear(12, 5)]
    return torchpar.pipeline.Pipeline(layers, nn.functional.cross_entropy, microbatches=2, balance=[2, 1])


def mismatched_stages(rank, world):
    pipe = mismatched_pipeline()
    inputs, target = batch(8)
    try:
        pipe.step(inputs, target)
    except RuntimeError as error:
        message = str(error)
    else:
        raise AssertionError("the mismatch went unnoticed")
    if rank == 1:
        os._exit(0)  # its peer learns of the failure as a dead stage, within the timeout
    return message


def test_stage_output_not_accepted_by_the_next_stage_names_stage_microbatch_and_shapes():
    start = time.monotonic()
    outcomes = launch_ranks(2, mismatched_stages, deadline_s=60, collective_timeout_s=20, grace_s=20)
    by_rank = {o.rank: o for o in outcomes}
    assert by_rank[0].passed, by_rank[0].message
    assert "pipeline stage 0, micro-batch 0: receiving gradients from rank 1 failed" in by_rank[0].value
    assert time.monotonic() - start < 20


def report_rank1_message(rank, world):
    pipe = mismatched_pipeline()
    inputs, target = batch(8)
    if rank == 0:
        pipe.step(inputs, target)  # fails once rank 1 is gone; the test looks at rank 1's message only
    try:
        pipe.step(inputs, target)
    except RuntimeError as error:
        message = str(error)
    else:
        raise AssertionError("the mismatch went unnoticed")
    try:
        pipe.step(inputs, target)  # must not pair its messages with a peer stuck in the failed step
    except RuntimeError as error:
        assert "an earlier step or forward failed on this rank (rank 1)" in str(error), str(error)
        return message
    raise AssertionError("a pipeline that failed ran another step")


def test_the_receiving_stage_explains_the_mismatch_and_refuses_further_steps():
    outcomes = launch_ranks(2, report_rank1_message, deadline_s=60, collective_timeout_s=10, grace_s=0.5)
    message = outcomes[1].value
    assert outcomes[1].passed and message, outcomes[1].message
    assert "pipeline stage 1 (layers 2-2), micro-batch 0: layer 2 (2) failed on inputs [4, 16] Float" in message, message
    assert message.endswith("mat1 and mat2 shapes cannot be multiplied (4x16 and 12x5)"), message


def dead_stage(rank, world):
    pipe = torchpar.pipeline.Pipeline(deep_mlp(), nn.functional.cross_entropy, schedule="1f1b", microbatches=4)
    inputs, target = batch(16)
    pipe.step(inputs, target)
    if rank == 1:
        os._exit(3)  # the second stage's process dies between steps
    start = time.monotonic()
    try:
        pipe.step(inputs, target)
    except RuntimeError as error:
        return str(error), time.monotonic() - start
    raise AssertionError("a step without its second stage succeeded")


def test_dead_stage_is_reported_within_the_timeout():
    outcomes = launch_ranks(2, dead_stage, deadline_s=60, collective_timeout_s=10, grace_s=30)
    assert outcomes[0].passed, outcomes[0].message
    message, seconds = outcomes[0].value
    assert "pipeline stage 0, micro-batch 0: receiving gradients from rank 1 failed" in message, message
    assert seconds < 10, seconds
