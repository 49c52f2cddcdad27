"""A rank's piece of a parameter (a flat range of its elements, as ShardedDataParallel's shards hold them) in the form
``torch.distributed.checkpoint`` saves and loads as part of a tensor shaped like the parameter: its
``CheckpointableTensor`` protocol (torch 2.15). The checkpoint then holds every parameter, and every per-element
optimizer state, whole and shaped like the parameter, as FSDP2's and a bare model's do: any number of ranks, FSDP2
or one process loads it, each taking the part it needs.

A flat range of a row-major tensor is not one rectangle: it is at most ``2 * dim - 1`` of them (a partial first row, the
full rows, a partial last row, recursively). DCP slices each rectangle out of one local tensor, so the piece is laid
into the smallest box of whole rows around it (at most two rows more than the piece), and copied back after a load.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


def _rectangles(shape: Sequence[int], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (offsets, sizes) rectangles that elements [start, end) of a row-major tensor of `shape` make up."""
    if not shape:
        return [((), ())]
    row = math.prod(shape[1:])
    first, last = start // row, (end - 1) // row
    if first == last:
        return [((first, *offsets), (1, *sizes))
                for offsets, sizes in _rectangles(shape[1:], start - first * row, end - first * row)]
    rectangles = []
    full_from, full_to = first, last + 1
    if start % row:
        rectangles += [((first, *offsets), (1, *sizes))
                       for offsets, sizes in _rectangles(shape[1:], start - first * row, row)]
        full_from += 1
    if end % row:
        full_to -= 1
    if full_to > full_from:
        rectangles.append(((full_from, *[0] * (len(shape) - 1)), (full_to - full_from, *shape[1:])))
    if end % row:
        rectangles += [((last, *offsets), (1, *sizes))
                       for offsets, sizes in _rectangles(shape[1:], 0, end - last * row)]
    return rectangles


def _box(shape: Sequence[int], start: int, end: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The smallest box of whole rows holding elements [start, end): its offsets and sizes in the tensor, and the
    flat index of its first element. Outer dimensions the range stays within one index of are kept at size 1."""
    offsets: list[int] = []
    flat_origin = 0
    for dim in range(len(shape)):
        row = math.prod(shape[dim + 1:])
        first, last = start // row, (end - 1) // row
        if first != last or dim == len(shape) - 1:
            sizes = (1,) * dim + (last - first + 1, *shape[dim + 1:])
            return (*offsets, first, *[0] * (len(shape) - dim - 1)), sizes, flat_origin + first * row
        offsets.append(first)
        flat_origin += first * row
        start, end = start - first * row, end - first * row
    return (), (), 0  # a 0-dimensional parameter: the box is the whole of it


def checkpointable_piece(piece: torch.Tensor, shape: Sequence[int], start: int) -> torch.Tensor:
    """`piece` (1-D: the elements from flat index `start` of a tensor of `shape`) copied into a tensor DCP saves, and
    loads into, as that part of a tensor of `shape`. ``piece_of`` reads the piece back out of it."""
    shape = tuple(int(size) for size in shape)
    end = start + piece.numel()
    box_offsets, box_sizes, flat_origin = _box(shape, start, end)
    box = torch.empty(box_sizes, dtype=piece.dtype, device=piece.device)
    box.view(-1)[start - flat_origin:end - flat_origin] = piece
    rectangles = _rectangles(shape, start, end)
    box.global_shape = shape
    box.global_offsets = tuple(offsets for offsets, _ in rectangles)
    box.local_offsets = tuple(tuple(o - b for o, b in zip(offsets, box_offsets)) for offsets, _ in rectangles)
    box.local_sizes = tuple(sizes for _, sizes in rectangles)
    box._torchpar_flat_range = (start - flat_origin, end - flat_origin)
    return box


def piece_of(box: torch.Tensor) -> torch.Tensor:
    """The piece ``checkpointable_piece`` laid into `box` (a view: what a load wrote there)."""
    begin, end = box._torchpar_flat_range
    return box.view(-1)[begin:end]
