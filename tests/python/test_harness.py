"""The Python harness turns every way a rank can go wrong into a reported failure, in time."""
import os
import time

import pytest
import torch.distributed as dist

from rank_harness import RankFailure, launch_ranks, run_on_ranks


def passes(rank, world):
    dist.barrier()
    return rank * 10


def crashes(rank, world):
    if rank == 1:
        os.abort()
    dist.barrier()


# Ranks meet first where one fails or leaves early: one still connecting its group would fail on its own.
def hangs(rank, world):
    dist.barrier()
    if rank == 0:
        time.sleep(3600)


def raises(rank, world):
    dist.barrier()
    assert rank != 2, "rank two disagrees"


def test_values_come_back_in_rank_order():
    assert run_on_ranks(3, passes) == [0, 10, 20]


def test_a_crashed_rank_fails_the_run():
    outcomes = launch_ranks(2, crashes)
    assert not outcomes[1].passed
    assert "signal 6" in outcomes[1].message
    assert not outcomes[0].passed  # it either saw the dead peer or was killed


def test_a_hung_rank_is_killed_at_the_deadline():
    start = time.monotonic()
    outcomes = launch_ranks(2, hangs, deadline_s=20)
    assert time.monotonic() - start < 60
    assert not outcomes[0].passed
    assert "still running at the deadline of 20 s" in outcomes[0].message
    assert outcomes[1].passed


def test_an_assertion_on_one_rank_fails_the_run_with_its_traceback():
    with pytest.raises(RankFailure, match="(?s)1 of 3 ranks failed.*rank two disagrees"):
        run_on_ranks(3, raises)
