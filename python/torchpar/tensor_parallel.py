"""Tensor (intra-layer) parallelism: one layer's weights split over the ranks of a tensor-parallel group.

    grid = torchpar.ParallelGrid(data=2, pipeline=1, tensor=2)        # under torchrun, 4 ranks
    tp = grid.tensor_group
    torch.manual_seed(0)                                              # the same seed on every rank
    mlp = nn.Sequential(
        torchpar.tensor_parallel.ColumnParallelLinear(1024, 4096, group=tp),   # output features split
        nn.GELU(),
        torchpar.tensor_parallel.RowParallelLinear(4096, 1024, group=tp),      # input features split
    )

Each rank builds the full single-process layer from the global generator and keeps its slice, so with the
same seed the shards together hold exactly what ``nn.Linear`` / ``nn.Embedding`` would. A column layer
followed by a row layer costs one all-reduce in forward and one in backward. The communication and the
shards come from the C++ engine (``torchpar::tensor_parallel``), the same one LibTorch programs use.
"""
from __future__ import annotations

import datetime
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from torchpar._C import tensor_parallel as _engine

__all__ = [
    "ColumnParallelLinear",
    "ParallelGrid",
    "RowParallelLinear",
    "SequenceParallelLayerNorm",
    "TensorParallelRandom",
    "VocabParallelEmbedding",
    "clip_grad_norm_",
    "copy_to_tensor_parallel",
    "full_state_dict",
    "gather_from_sequence_parallel",
    "gather_from_tensor_parallel",
    "load_full_state_dict",
    "parameter_layouts",
    "reduce_from_tensor_parallel",
    "reduce_scatter_to_sequence_parallel",
    "scatter_to_sequence_parallel",
    "scatter_to_tensor_parallel",
    "vocab_parallel_cross_entropy",
]

# The conjugate communication functions (autograd-aware): see torchpar/tensor_parallel/mappings.h.
copy_to_tensor_parallel = _engine.copy_to_tensor_parallel
reduce_from_tensor_parallel = _engine.reduce_from_tensor_parallel
scatter_to_tensor_parallel = _engine.scatter_to_tensor_parallel
gather_from_tensor_parallel = _engine.gather_from_tensor_parallel
scatter_to_sequence_parallel = _engine.scatter_to_sequence_parallel
gather_from_sequence_parallel = _engine.gather_from_sequence_parallel
reduce_scatter_to_sequence_parallel = _engine.reduce_scatter_to_sequence_parallel


def _group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    if group is not None:
        return group
    if not dist.is_initialized():
        raise RuntimeError("torchpar.tensor_parallel: no process group; call torchpar.init_process_group() first "
                           "or pass group=")
    return dist.group.WORLD


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: Optional[dist.ProcessGroup] = None, *, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(full_logits, target, ignore_index=, label_smoothing=, reduction=)`` where each rank of
    ``group`` holds its vocabulary slice of the logits (``[*, V / size]``, a :class:`ColumnParallelLinear`'s
    output): the same loss and gradient, on every rank, without gathering the logits. ``target`` is ``[*]``,
    the same on every rank. ``reduction="mean"`` (as ``F.cross_entropy``) averages over the targets that are
    not ``ignore_index``; ``"none"`` gives the loss per position.
    """
    return _engine.vocab_parallel_cross_entropy(logits, target, _group(group), ignore_index, label_smoothing,
                                                reduction)


def _optional_parameter(module: nn.Module, name: str, tensor: Optional[torch.Tensor]) -> None:
    module.register_parameter(name, nn.Parameter(tensor) if tensor is not None else None)


class ColumnParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with the output features split over ``group``.

    Each rank holds ``out_features / group size`` rows of the weight. ``gather_output`` all-gathers the
    output (else each rank keeps its slice, the input of a :class:`RowParallelLinear`);
    ``sequence_parallel``: the input is split along dim 0 and all-gathered here.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: Optional[dist.ProcessGroup] = None, gather_output: bool = False,
                 sequence_parallel: bool = False, name: str = "ColumnParallelLinear"):
        super().__init__()
        self.group = _group(group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel, self.name = gather_output, sequence_parallel, name
        weight, bias_shard = _engine.column_parallel_shards(self.group, in_features, out_features, bias, name)
        self.weight = nn.Parameter(weight)
        _optional_parameter(self, "bias", bias_shard)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _engine.column_parallel_linear(input, self.weight, self.bias, self.group, self.gather_output,
                                              self.sequence_parallel, self.name)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.weight.shape[0]} here), bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with the input features split over ``group``.

    Each rank holds ``in_features / group size`` columns of the weight; the partial outputs are summed
    over the group (reduce-scattered along dim 0 with ``sequence_parallel``), then the bias, replicated,
    is added. ``input_is_parallel=False`` slices a full input here.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: Optional[dist.ProcessGroup] = None, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, name: str = "RowParallelLinear"):
        super().__init__()
        self.group = _group(group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.name = input_is_parallel, sequence_parallel, name
        weight, bias_full = _engine.row_parallel_shards(self.group, in_features, out_features, bias, name)
        self.weight = nn.Parameter(weight)
        _optional_parameter(self, "bias", bias_full)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _engine.row_parallel_linear(input, self.weight, self.bias, self.group, self.input_is_parallel,
                                           self.sequence_parallel, self.name)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.weight.shape[1]} here), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with the rows split by id range over ``group``.

    Rank r holds ids ``[r * V / size, (r + 1) * V / size)``; ids outside its range contribute zeros and the
    rows are summed over the group. An id outside ``[0, num_embeddings)`` is an error naming the layer.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Optional[dist.ProcessGroup] = None,
                 sequence_parallel: bool = False, name: str = "VocabParallelEmbedding"):
        super().__init__()
        self.group = _group(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel, self.name = sequence_parallel, name
        self.weight = nn.Parameter(_engine.vocab_parallel_shard(self.group, num_embeddings, embedding_dim, name))
        self.vocab_range = _engine.vocab_range(num_embeddings, self.group.rank(), self.group.size())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _engine.vocab_parallel_embedding(ids, self.weight, self.group, self.num_embeddings,
                                                self.sequence_parallel, self.name)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, ids [{self.vocab_range[0]}, {self.vocab_range[1]}) here"


class SequenceParallelLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` for the sequence-parallel regions between tensor-parallel layers.

    Each rank normalises its own slice of the sequence with the same (replicated) weight and bias; their
    gradients are summed over ``group`` in backward, so the ranks' copies stay equal after every step.
    Dropout in these regions belongs in :meth:`TensorParallelRandom.fork` (different positions, different
    masks).
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, *,
                 group: Optional[dist.ProcessGroup] = None, **factory):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, **factory)
        self.group = _group(group)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _engine.sequence_parallel_layer_norm(input, list(self.normalized_shape), self.weight, self.bias,
                                                    self.eps, self.group)


def parameter_layouts(module: nn.Module) -> list[tuple[str, nn.Parameter, int]]:
    """Every parameter of ``module`` as ``(name, parameter, split_dim)``: the dim a tensor-parallel layer
    splits it along over its group, or -1 when it is the same on every rank (replicated)."""
    split = {}
    for prefix, layer in module.named_modules():
        dims = ({"weight": 0, "bias": 0} if isinstance(layer, ColumnParallelLinear) else
                {"weight": 1} if isinstance(layer, RowParallelLinear) else
                {"weight": 0} if isinstance(layer, VocabParallelEmbedding) else {})
        split.update({f"{prefix}.{name}" if prefix else name: dim for name, dim in dims.items()})
    return [(name, p, split.get(name, -1)) for name, p in module.named_parameters()]


def clip_grad_norm_(module: nn.Module, max_norm: float, tensor_group: Optional[dist.ProcessGroup] = None,
                    pipeline_group: Optional[dist.ProcessGroup] = None) -> float:
    """``torch.nn.utils.clip_grad_norm_`` for a module holding tensor-parallel layers: the norm of the whole
    single-process model (shards summed over ``tensor_group``, replicated parameters counted once, and
    the stages' over ``pipeline_group``); returns it. Call it after the data-parallel average."""
    layouts = parameter_layouts(module)
    return _engine.clip_grad_norm([p for _, p, _ in layouts], [dim for _, _, dim in layouts], max_norm,
                                  _group(tensor_group), pipeline_group)


def full_state_dict(module: nn.Module, tensor_group: Optional[dist.ProcessGroup] = None) -> dict[str, torch.Tensor]:
    """The single-process ``state_dict``: every shard all-gathered (collective over ``tensor_group``; every
    rank gets the whole), replicated parameters and buffers as they are."""
    group = _group(tensor_group)
    state = {name: (_engine.all_gather(p.detach(), dim, group) if dim >= 0 else p.detach().clone())
             for name, p, dim in parameter_layouts(module)}
    state.update({name: b.detach().clone() for name, b in module.named_buffers()})
    return state


def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor],
                         tensor_group: Optional[dist.ProcessGroup] = None) -> None:
    """Loads a single-process ``state_dict``: each rank takes its slice of every shard."""
    group = _group(tensor_group)
    targets = [(name, p, dim) for name, p, dim in parameter_layouts(module)]
    targets += [(name, b, -1) for name, b in module.named_buffers()]
    with torch.no_grad():
        for name, target, dim in targets:
            if name not in state:
                raise KeyError(f"load_full_state_dict: the state_dict has no {name!r}")
            value = _engine.local_slice(state[name], dim, group, name) if dim >= 0 else state[name]
            if value.shape != target.shape:
                raise ValueError(f"load_full_state_dict: {name!r} has shape {list(state[name].shape)}, which gives "
                                 f"this rank {list(value.shape)} where the module holds {list(target.shape)}")
            target.copy_(value)


class TensorParallelRandom:
    """Megatron's dropout rule: seeds the default generator with ``seed`` (equal on the tensor group's ranks,
    for replicated activations) and this rank's split stream with ``seed + 2718 + tensor rank``, drawn from
    inside ``with random.fork():`` (for activations split over the group: heads, sequence-parallel regions).
    """

    def __init__(self, seed: int, tensor_group: Optional[dist.ProcessGroup] = None):
        self._engine = _engine.TensorParallelRandom(seed, _group(tensor_group))

    def fork(self):
        return self._engine.fork()


class ParallelGrid:
    """The job's ranks as a ``data × pipeline × tensor`` grid (tensor innermost, so a tensor group's ranks
    are consecutive and share a host), with this rank's coordinates and its three process groups.

    Every rank constructs it (it creates the groups collectively). ``backend`` and ``timeout`` are the
    groups' (default: ``TORCHPAR_BACKEND``/gloo and ``TORCHPAR_TIMEOUT``/30 min); ``world`` defaults to the
    default process group. The engine is C++'s ``torchpar::ParallelGrid``.
    """

    def __init__(self, data: int = 1, pipeline: int = 1, tensor: int = 1, *,
                 world: Optional[dist.ProcessGroup] = None, backend: str = "",
                 timeout: Optional[datetime.timedelta] = None):
        self._grid = _engine.ParallelGrid(_group(world), data, pipeline, tensor, backend, timeout)

    def __getattr__(self, name):
        # data_size, pipeline_index, tensor_group, rank_of(...) ...: the C++ grid's.
        return getattr(self.__dict__["_grid"], name)

    def __repr__(self) -> str:
        return f"ParallelGrid({self._grid!r})"
