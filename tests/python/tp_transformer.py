"""A pre-LayerNorm transformer block written twice: once with torchpar's tensor-parallel layers (attention
heads and the MLP's hidden features split over the tensor group), once with nn.Linear — built from the same
seed, so the two hold the same weights and must compute the same thing."""
import math

import torch
import torch.nn.functional as F
from torch import nn

import torchpar.tensor_parallel as tp


def attention(q, k, v, heads):
    """Causal self-attention over [batch, seq, heads * head_dim] projections, heads computed apart."""
    b, s, width = q.shape
    split = lambda t: t.view(b, s, heads, width // heads).transpose(1, 2)
    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(width // heads)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(b, s, width)


class Block(nn.Module):
    """``group=None``: the single-process reference; else the tensor-parallel block over ``group``."""

    def __init__(self, width, heads, hidden, group=None, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        size = group.size() if group is not None else 1
        column = (lambda i, o: tp.ColumnParallelLinear(i, o, group=group)) if group is not None else nn.Linear
        row = (lambda i, o: tp.RowParallelLinear(i, o, group=group)) if group is not None else nn.Linear
        self.heads = heads // size  # this rank's heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = column(width, width), column(width, width), column(width, width)
        self.out = row(width, width)
        self.up, self.down = column(width, hidden), row(hidden, width)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.out(attention(self.q(h), self.k(h), self.v(h), self.heads))
        return x + self.down(F.gelu(self.up(self.norm2(x))))
