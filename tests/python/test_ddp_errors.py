"""DDP's errors: different models on different ranks, and a rank that dies in the middle of backward."""
import os
import time

import torch
from torch import nn

import torchpar
from ddp_reference import loss_of, make_model
from rank_harness import launch_ranks, run_on_ranks


def construct_mismatched(rank, world):
    torch.manual_seed(0)
    hidden = 32 if rank != 2 else 24  # rank 2 built a different model
    model = nn.Sequential(nn.Linear(12, hidden), nn.ReLU(), nn.Linear(hidden, 5))
    try:
        torchpar.DistributedDataParallel(model)
    except RuntimeError as error:
        return str(error)
    raise AssertionError("DDP over different models was constructed without an error")


def test_mismatched_models_fail_on_every_rank_naming_the_parameter_and_ranks():
    messages = run_on_ranks(3, construct_mismatched, deadline_s=60, collective_timeout_s=20)
    for message in messages:
        assert "parameter 0.weight [32, 12] Float" in message, message
        assert "rank 2: parameter 0.weight [24, 12] Float" in message, message
        assert "ranks that differ from rank 0: 2." in message, message


def die_in_backward(rank, world):
    ddp = torchpar.DistributedDataParallel(make_model("mlp"), bucket_cap_mb=1e-9)
    inputs, targets = torch.randn(4, 12), torch.randint(0, 5, (4,))
    output = ddp(inputs)
    if rank == 1:
        # Dies after the last layer's gradient bucket was all-reduced, before the rest of backward.
        list(ddp.module.parameters())[0].register_hook(lambda grad: os._exit(3))
    start = time.monotonic()
    try:
        loss_of(output, targets).backward()
    except RuntimeError as error:
        return str(error), time.monotonic() - start
    raise AssertionError("backward succeeded although rank 1 died")


def test_a_rank_dying_mid_backward_gives_the_others_a_clear_error_within_the_timeout():
    outcomes = launch_ranks(2, die_in_backward, deadline_s=60, collective_timeout_s=10, grace_s=30)
    assert not outcomes[1].passed and "exited with code 3" in outcomes[1].message
    assert outcomes[0].passed, outcomes[0].message
    message, seconds = outcomes[0].value
    assert "DistributedDataParallel (rank 0)" in message and "gradient bucket" in message, message
    assert seconds < 15, f"the error took {seconds:.1f} s, past the 10 s timeout"


def backward_raises_midway(rank, world):
    ddp = torchpar.DistributedDataParallel(make_model("mlp"), bucket_cap_mb=1e-9)
    inputs, targets = torch.randn(4, 12), torch.randint(0, 5, (4,))
    first_weight = list(ddp.module.parameters())[0]
    handle = first_weight.register_hook(lambda grad: (_ for _ in ()).throw(ValueError("user hook failed")))
    try:
        loss_of(ddp(inputs), targets).backward()
    except ValueError:
        pass
    handle.remove()
    try:
        ddp(inputs)
    except RuntimeError as error:
        message = str(error)
    else:
        raise AssertionError("the forward after an unfinished backward did not report it")
    loss_of(ddp(inputs), targets).backward()  # the next full step works again
    return message


def test_a_backward_that_raised_midway_is_reported_at_the_next_forward():
    for message in run_on_ranks(2, backward_raises_midway, deadline_s=60, collective_timeout_s=20):
        assert "previous backward stopped before all gradient buckets were reduced" in message, message
