"""benchmarks/pipeline_replay.py's replay: the makespan of recorded per-rank orders under the schedules' dependencies,
checked on timelines worked out by hand."""
import sys

import pytest

from test_torchrun import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from pipeline_replay import replay  # noqa: E402


def test_forwards_wait_for_the_previous_stage_and_backwards_for_the_next_one_transfer_later():
    # GPipe, 2 stages, 2 micro-batches, forwards 1 ms, backwards 2 ms, transfers 0.5 ms. Stage 1: F 1.5-2.5, 2.5-3.5,
    # B(1) 3.5-5.5, B(0) 5.5-7.5; stage 0: F 0-1, 1-2, then B(1) from 5.5 + 0.5 to 8, B(0) from 7.5 + 0.5 to 10.
    first = [("F", 0, 0, 1.0), ("F", 0, 1, 1.0), ("B", 0, 1, 2.0), ("B", 0, 0, 2.0)]
    last = [("F", 1, 0, 1.0), ("F", 1, 1, 1.0), ("B", 1, 1, 2.0), ("B", 1, 0, 2.0)]
    assert replay([first, last], transfer_ms=0.5) == pytest.approx(10.0)
    assert replay([first, last], transfer_ms=0.0) == pytest.approx(9.0)


def test_a_split_backward_sends_upstream_from_its_input_gradient():
    # ZB-H1's split backward, one micro-batch, free transfers: stage 1 runs F 1-2, I 2-3, W 3-4; stage 0's I needs
    # stage 1's I (3): I 3-4, W 4-5.
    first = [("F", 0, 0, 1.0), ("I", 0, 0, 1.0), ("W", 0, 0, 1.0)]
    last = [("F", 1, 0, 1.0), ("I", 1, 0, 1.0), ("W", 1, 0, 1.0)]
    assert replay([first, last], transfer_ms=0.0) == pytest.approx(5.0)


def test_orders_that_wait_on_each_other_are_refused():
    first = [("B", 0, 0, 1.0), ("F", 0, 0, 1.0)]  # its backward before the forward the next stage needs
    last = [("F", 1, 0, 1.0), ("B", 1, 0, 1.0)]
    with pytest.raises(RuntimeError, match="wait on each other"):
        replay([first, last], transfer_ms=0.0)
