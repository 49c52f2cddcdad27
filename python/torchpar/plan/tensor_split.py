"""Layers a tensor group can split (an ``nn.Linear``, alone or followed by elementwise activations in an
``nn.Sequential``), the elementwise layers that can run on the split between two of them, and the same model
rebuilt with them split, as the cost model's roles say (``torchpar._C.plan.tensor_parallel_roles``), for
``--verify``."""
from __future__ import annotations

import copy
from typing import Optional

from torch import nn

import torchpar.tensor_parallel as tp

_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Dropout, nn.Identity)


def splittable_linear(layer: nn.Module) -> Optional[nn.Linear]:
    """The layer's Linear if the layer is one, or a Sequential of one followed by elementwise activations."""
    if isinstance(layer, nn.Linear):
        return layer
    if isinstance(layer, nn.Sequential) and len(layer) and isinstance(layer[0], nn.Linear) and all(
            isinstance(after, _ELEMENTWISE) for after in list(layer)[1:]):
        return layer[0]
    return None


def elementwise(layer: nn.Module) -> bool:
    """The layer acts on each element alone (an activation, dropout, or a Sequential of those)."""
    if isinstance(layer, nn.Sequential):
        return len(layer) > 0 and all(isinstance(each, _ELEMENTWISE) for each in layer)
    return isinstance(layer, _ELEMENTWISE)


def split_layer(layer: nn.Module, role: str, group) -> nn.Module:
    """A copy of `layer` in its role over the tensor group `group` (every rank of it calls this); an
    "elementwise" layer runs unchanged on the split between a column and a row."""
    if role in ("whole", "elementwise"):
        return copy.deepcopy(layer)
    linear = splittable_linear(layer)
    bias = linear.bias is not None
    if role == "row":
        split = tp.RowParallelLinear(linear.in_features, linear.out_features, bias, group=group)
    else:
        split = tp.ColumnParallelLinear(linear.in_features, linear.out_features, bias, group=group,
                                        gather_output=role == "column_gathered")
    return split if isinstance(layer, nn.Linear) else nn.Sequential(split, *copy.deepcopy(list(layer)[1:]))


def split_model(layers: list[nn.Module], roles: list[str], group) -> nn.Sequential:
    """`layers` with each one's role applied over the tensor group `group` (every rank of it calls this)."""
    return nn.Sequential(*[split_layer(layer, role, group) for layer, role in zip(layers, roles)])
