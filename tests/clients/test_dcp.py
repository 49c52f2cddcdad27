"""torch.distributed.checkpoint around torchpar: checkpoints move between torch's DDP, torchpar's DDP and a bare
model, through dcp.save/dcp.load of state_dict() and through get_model_state_dict/set_model_state_dict."""
import itertools

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import torchpar
from rank_harness import run_on_ranks

KINDS = ("torch_ddp", "torchpar_ddp", "bare")


def build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
    if kind == "torch_ddp":
        return nn.parallel.DistributedDataParallel(model)
    if kind == "torchpar_ddp":
        return torchpar.DistributedDataParallel(model)
    return model


def trained(kind: str) -> nn.Module:
    """A model whose values differ from any fresh one: one SGD step (BatchNorm's running stats move too). The same
    batch on every rank: DDP keeps buffers as each rank computed them until the next forward, and a checkpoint
    holds one copy of what is replicated."""
    model = build(kind, seed=1)
    torch.manual_seed(3)
    nn.functional.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return model


def bare(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def assert_same_values(loaded: nn.Module, saved: nn.Module, context: str) -> None:
    expected = bare(saved).state_dict()
    got = bare(loaded).state_dict()
    assert got.keys() == expected.keys(), context
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{context}: {name} differs"


def round_trips(rank, world, directory):
    assert isinstance(torchpar.DistributedDataParallel(nn.Linear(2, 2)), nn.parallel.DistributedDataParallel)
    sources = {kind: trained(kind) for kind in KINDS}
    # The helpers give every wrapper the bare model's keys.
    for kind, model in sources.items():
        assert set(get_model_state_dict(model)) == set(bare(model).state_dict()), kind
    for source, target in itertools.product(KINDS, KINDS):
        checkpoint = f"{directory}/helpers-{source}"
        if target == KINDS[0]:
            dcp.save(get_model_state_dict(sources[source]), checkpoint_id=checkpoint)
        model = build(target, seed=2)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=checkpoint)
        set_model_state_dict(model, state)
        assert_same_values(model, sources[source], f"helpers: {source} -> {target}")
    # state_dict() itself: both DDPs' keys carry torch's "module." prefix, so their checkpoints are interchangeable.
    wrapped = ("torch_ddp", "torchpar_ddp")
    for source, target in itertools.product(wrapped, wrapped):
        checkpoint = f"{directory}/plain-{source}"
        if target == wrapped[0]:
            dcp.save(sources[source].state_dict(), checkpoint_id=checkpoint)
        model = build(target, seed=2)
        state = model.state_dict()
        dcp.load(state, checkpoint_id=checkpoint)
        model.load_state_dict(state)
        assert_same_values(model, sources[source], f"state_dict: {source} -> {target}")
    return True


def test_dcp_round_trips_between_torch_ddp_torchpar_ddp_and_a_bare_model(tmp_path):
    assert run_on_ranks(2, round_trips, str(tmp_path), deadline_s=180) == [True, True]
