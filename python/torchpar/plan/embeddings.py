"""Embedding tables a parameter server can hold as sparse rows: found in a model's layers for the cost model
(``torchpar.plan``'s layer traits; the engine counts the first layer's, fed the model's integer inputs), and
swapped for ``torchpar.ps.Embedding`` when ``--verify`` runs the parameter server."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn

import torchpar.ps

if TYPE_CHECKING:
    from torchpar.plan.model import Model

_BAG_REDUCTIONS = {"mean": torch.mean, "sum": torch.sum}


def sparse_able(module: nn.Module) -> bool:
    """An embedding a parameter server can hold as sparse rows (a bag only under a mean or a sum)."""
    return isinstance(module, nn.Embedding) or (isinstance(module, nn.EmbeddingBag) and
                                                module.mode in _BAG_REDUCTIONS)


class _RemoteBag(nn.Module):
    """nn.EmbeddingBag's mean or sum over each sample's ids (2-D ids), with rows on the servers."""

    def __init__(self, table: torchpar.ps.Embedding, mode: str):
        super().__init__()
        self.table, self.reduce = table, _BAG_REDUCTIONS[mode]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.table(ids), dim=1)


def with_remote_embeddings(layer: nn.Module, client, optimizer, prefix: str) -> nn.Module:
    """`layer` with each of its embeddings replaced by a ``torchpar.ps.Embedding`` (table `prefix` + its name)."""
    if sparse_able(layer):
        table = torchpar.ps.Embedding(client, prefix, layer.num_embeddings, layer.embedding_dim, optimizer)
        return table if isinstance(layer, nn.Embedding) else _RemoteBag(table, layer.mode)
    for name, child in list(layer.named_children()):
        setattr(layer, name, with_remote_embeddings(child, client, optimizer, f"{prefix}.{name}"))
    return layer


def build_with_remote_embeddings(model: "Model", index: int, client, optimizer, prefix: str) -> nn.Module:
    """A fresh copy of `model`'s layer `index` with its embeddings on the servers (:func:`with_remote_embeddings`),
    made without ever holding a whole table on this worker, which is what a parameter server is chosen for: a
    factory builds the layer on the meta device, a module is copied with meta tensors for its tables. What remains
    on the meta device is then made on the CPU and initialised afresh by its modules' ``reset_parameters``."""
    spec = model.layers[index]
    if isinstance(spec, nn.Module):
        memo = {id(m.weight): nn.Parameter(m.weight.detach().to("meta"), requires_grad=m.weight.requires_grad)
                for m in spec.modules() if sparse_able(m)}
        layer = copy.deepcopy(spec, memo)
    else:
        with torch.device("meta"):
            layer = spec()
    layer = with_remote_embeddings(layer, client, optimizer, prefix)
    if any(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):
        layer = layer.to_empty(device="cpu")
        for module in layer.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return layer
