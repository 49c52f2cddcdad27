"""A flat piece of a parameter laid out for torch.distributed.checkpoint (torchpar.sharded_dcp), in one process: its
rectangles cover exactly its elements of the whole tensor, and the box around them stays small."""
import math
import random

import pytest
import torch

from torchpar.sharded_dcp import checkpointable_piece, piece_of

SHAPES = [(), (1,), (7,), (5, 3), (3, 1, 4), (2, 3, 4, 5), (1, 1, 6), (4, 1)]


def ranges(numel: int):
    """Every range of small tensors; ranges at random, whole rows and single elements of larger ones."""
    if numel <= 24:
        return [(start, end) for start in range(numel) for end in range(start + 1, numel + 1)]
    rng = random.Random(numel)
    at_random = [tuple(sorted(rng.sample(range(numel + 1), 2))) for _ in range(200)]
    return [(0, numel), (numel - 1, numel), (0, 1)] + at_random


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_pieces_rectangles_cover_exactly_its_elements_of_the_whole_tensor(shape):
    numel = math.prod(shape)
    values = torch.arange(numel, dtype=torch.float64)
    for start, end in ranges(numel):
        box = checkpointable_piece(values[start:end], shape, start)
        assert box.global_shape == shape
        assert len(box.global_offsets) <= max(1, 2 * len(shape) - 1)
        # What a checkpoint holds of this rank: each rectangle of the whole, taken from the box where DCP slices it.
        whole = torch.full(shape, float("nan"), dtype=torch.float64)
        for offsets, local, sizes in zip(box.global_offsets, box.local_offsets, box.local_sizes):
            target = whole[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
            assert torch.isnan(target).all(), f"{shape} [{start}, {end}): rectangles overlap at {offsets}"
            target.copy_(box[tuple(slice(o, o + n) for o, n in zip(local, sizes))])
        flat = whole.reshape(-1)
        assert torch.equal(flat[start:end], values[start:end]), f"{shape} [{start}, {end})"
        assert torch.isnan(torch.cat([flat[:start], flat[end:]])).all(), f"{shape} [{start}, {end}) covers more"
        row = math.prod(shape[1:]) if shape else 1
        assert box.numel() <= end - start + 2 * row
        assert torch.equal(piece_of(box), values[start:end])


def test_a_load_into_the_box_reaches_the_piece():
    box = checkpointable_piece(torch.zeros(9), (4, 5), 3)  # elements 3..11: row 0's last two, row 1, row 2's first two
    assert box.global_offsets == ((0, 3), (1, 0), (2, 0))
    assert box.local_sizes == ((1, 2), (1, 5), (1, 2))
    for local, sizes in zip(box.local_offsets, box.local_sizes):
        box[tuple(slice(o, o + n) for o, n in zip(local, sizes))] = 1.0
    assert torch.equal(piece_of(box), torch.ones(9))


def test_the_protocol_is_what_dcp_recognises():
    from torch.distributed.checkpoint.protocol import _is_checkpointable_tensor
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    box = checkpointable_piece(torch.arange(4.0), (3, 3), 2)
    assert _is_checkpointable_tensor(box)
    items = _create_write_items("w", box)
    assert [tuple(item.tensor_data.chunk.offsets) for item in items] == [(0, 2), (1, 0)]  # element 2, then row 1
    assert all(tuple(item.tensor_data.size) == (3, 3) for item in items)


def test_every_split_into_ranks_tiles_the_tensor():
    shape = (3, 4, 5)
    numel = math.prod(shape)
    rng = random.Random(0)
    for _ in range(300):
        bounds = (0, *sorted(rng.sample(range(1, numel), 3)), numel)
        covered = torch.zeros(shape, dtype=torch.int64)
        for start, end in zip(bounds, bounds[1:]):
            box = checkpointable_piece(torch.zeros(end - start), shape, start)
            for offsets, sizes in zip(box.global_offsets, box.local_sizes):
                covered[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] += 1
        assert (covered == 1).all(), bounds
