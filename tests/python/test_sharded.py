"""Sharded data parallelism (ZeRO stages 1 and 2) on real ranks: training equal to one process on the global batch
(and to torch's DDP where BatchNorm keeps per-rank statistics), with SGD-momentum and Adam, parameter sizes that do
not divide by the group, a frozen and a tied parameter; no_sync accumulation; clipping; what a rank holds."""
import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchpar
from rank_harness import launch_ranks, run_on_ranks

STEPS, PER_RANK, VOCABULARY = 3, 4, 11
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "adam": (torch.optim.Adam, dict(lr=0.01)),
}


class TiedNet(nn.Module):
    """Sizes 11x6, 6x13, 13, ... none divisible by 2, 3 or 4; `frozen` trains nothing; `decoder` is `embed`."""

    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(6, 13)
        self.norm = nn.BatchNorm1d(13) if batch_norm else nn.Identity()
        self.out = nn.Linear(13, 6)
        self.decoder = nn.Linear(6, VOCABULARY, bias=False)
        self.decoder.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.norm(self.hidden(self.frozen(self.embed(ids)))))
        return self.decoder(self.out(hidden))


def build(batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return TiedNet(batch_norm)


def batches(world: int):
    generator = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCABULARY, (world * PER_RANK,), generator=generator),
             torch.randint(0, VOCABULARY, (world * PER_RANK,), generator=generator)) for _ in range(STEPS)]


def loss_of(model, ids, targets):
    return nn.functional.cross_entropy(model(ids), targets)


def one_process(optimizer_name, world, clip=None):
    model = build()
    optimizer_class, defaults = OPTIMIZERS[optimizer_name]
    optimizer = optimizer_class(model.parameters(), **defaults)
    for ids, targets in batches(world):
        optimizer.zero_grad()
        loss_of(model, ids, targets).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model


def assert_same_model(got, expected, context, rtol=1e-5, atol=1e-6):
    for (name, a), (_, b) in zip(got.named_parameters(), expected.named_parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{context} {name}: {m}")


def sharded_training(rank, world):
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for stage in (1, 2):
        for optimizer_name, (optimizer_class, defaults) in OPTIMIZERS.items():
            context = f"stage {stage} {optimizer_name} on {world} ranks"
            model = torchpar.ShardedDataParallel(build(), stage=stage)
            optimizer = torchpar.ShardedOptimizer(model, optimizer_class, **defaults)
            for ids, targets in batches(world):
                optimizer.zero_grad()
                loss_of(model, ids[mine], targets[mine]).backward()
                held = [p.grad is not None for p in model.module.parameters() if p.requires_grad]
                # Stage 2 releases each gradient once its bucket is reduced; stage 1 keeps the local ones.
                assert all(held) if stage == 1 else not any(held), (context, held)
                optimizer.step()
            assert_same_model(model.module, one_process(optimizer_name, world), context)
            assert model.module.decoder.weight is model.module.embed.weight
            # What this rank holds: 1/N of the trained elements (+ padding), and the optimizer's state on it only.
            trained = sum(p.numel() for p in model.module.parameters() if p.requires_grad)
            shard = sum(s.numel() for s in model.shard_parameters())
            assert trained / world <= shard <= trained / world + len(list(model.module.parameters())), (shard, trained)
            if optimizer_name == "adam":
                state = optimizer.state[model.shard_parameters()[0]]
                assert state["exp_avg"].numel() == state["exp_avg_sq"].numel() == shard
            # A reduce-scatter and an all-gather of the padded buckets: DDP's ring all-reduce bytes.
            assert model.bytes_sent_last_step == 2 * model._coordinator.reduce_scatter_bytes
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_stages_1_and_2_train_as_one_process_on_the_global_batch(world):
    assert run_on_ranks(world, sharded_training, backend="shm" if world == 4 else "gloo", deadline_s=300) \
        == [True] * world


def accumulation_clipping_and_batch_norm(rank, world):
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    half = PER_RANK // 2
    # no_sync: two half batches, the first accumulated locally; clipping over every shard.
    for stage in (1, 2):
        model = torchpar.ShardedDataParallel(build(), stage=stage)
        optimizer = torchpar.ShardedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
        for ids, targets in batches(world):
            ids, targets = ids[mine], targets[mine]
            optimizer.zero_grad()
            with model.no_sync():
                (loss_of(model, ids[:half], targets[:half]) / 2).backward()
            (loss_of(model, ids[half:], targets[half:]) / 2).backward()
            norm = model.clip_grad_norm_(0.05)
            assert norm > 0.05  # the clip bites
            optimizer.step()
        assert_same_model(model.module, one_process("sgd", world, clip=0.05), f"stage {stage} no_sync + clip")
    # BatchNorm: each rank's statistics of its own batch, rank 0's buffers broadcast before each forward,
    # exactly as torch's DDP does.
    for stage in (1, 2):
        ours = torchpar.ShardedDataParallel(build(batch_norm=True), stage=stage)
        theirs = nn.parallel.DistributedDataParallel(build(batch_norm=True))
        ours_optimizer = torchpar.ShardedOptimizer(ours, torch.optim.Adam, lr=0.01)
        theirs_optimizer = torch.optim.Adam(theirs.parameters(), lr=0.01)
        for ids, targets in batches(world):
            for model, optimizer in ((ours, ours_optimizer), (theirs, theirs_optimizer)):
                optimizer.zero_grad()
                loss_of(model, ids[mine], targets[mine]).backward()
                optimizer.step()
        assert_same_model(ours.module, theirs.module, f"stage {stage} BatchNorm against torch's DDP")
        assert torch.equal(ours.module.norm.running_mean, theirs.module.norm.running_mean)
    return True


def test_no_sync_clipping_and_batch_norm_as_one_process_and_torch_ddp():
    assert run_on_ranks(2, accumulation_clipping_and_batch_norm, deadline_s=300) == [True, True]


def refusals(rank, world):
    with pytest.raises(RuntimeError, match="stage 4 does not exist"):
        torchpar.ShardedDataParallel(build(), stage=4)
    torch.manual_seed(rank)
    different = nn.Linear(4, 4 + rank)
    with pytest.raises(RuntimeError, match="ShardedDataParallel: the model differs across ranks"):
        torchpar.ShardedDataParallel(different)
    model = torchpar.ShardedDataParallel(build())
    with pytest.raises(TypeError, match="needs a torchpar.ShardedDataParallel"):
        torchpar.ShardedOptimizer(model.module, torch.optim.SGD, lr=0.1)
    return True


def test_refusals_name_what_is_wrong():
    assert run_on_ranks(2, refusals) == [True, True]


def take_steps(model, optimizer, steps, rows: slice) -> None:
    for ids, targets in steps:
        optimizer.zero_grad()
        loss_of(model, ids[rows], targets[rows]).backward()
        optimizer.step()


def save_after_two_steps(rank, world, directory):
    """4 ranks: two Adam steps, then the whole model and optimizer state saved; the third step's result returned."""
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    model = torchpar.ShardedDataParallel(build(), stage=2)
    optimizer = torchpar.ShardedOptimizer(model, torch.optim.Adam, lr=0.01)
    steps = batches(world)
    take_steps(model, optimizer, steps[:2], mine)
    full = optimizer.full_state_dict()
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": full}, f"{directory}/checkpoint.pt")
    take_steps(model, optimizer, steps[2:], mine)
    return {name: p.detach().clone() for name, p in model.module.named_parameters()}


def resume_on_another_group_size(rank, world, directory):
    """The 4-rank checkpoint loaded on this group size; the third step of the same global batch taken."""
    checkpoint = torch.load(f"{directory}/checkpoint.pt")
    module = build()
    module.load_state_dict(checkpoint["model"])
    model = torchpar.ShardedDataParallel(module, stage=2)
    optimizer = torchpar.ShardedOptimizer(model, torch.optim.Adam, lr=0.01)
    optimizer.load_full_state_dict(checkpoint["optimizer"])
    share = 4 * PER_RANK // world
    take_steps(model, optimizer, batches(4)[2:], slice(rank * share, (rank + 1) * share))
    return {name: p.detach().clone() for name, p in model.module.named_parameters()}


def test_a_checkpoint_of_4_ranks_resumes_on_2_ranks_and_in_a_bare_model(tmp_path):
    continued = run_on_ranks(4, save_after_two_steps, str(tmp_path), deadline_s=180)[0]
    resumed = run_on_ranks(2, resume_on_another_group_size, str(tmp_path), deadline_s=180)
    for rank_values in resumed:
        for name, value in continued.items():
            torch.testing.assert_close(rank_values[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # The full state is keyed by parameter name: torch's own Adam on the bare model takes it as is.
    checkpoint = torch.load(tmp_path / "checkpoint.pt")
    bare = build()
    bare.load_state_dict(checkpoint["model"])
    trained = [(name, p) for name, p in bare.named_parameters() if p.requires_grad]
    optimizer = torch.optim.Adam([p for _, p in trained], lr=0.01)
    names = [name for name, _ in trained]
    saved = checkpoint["optimizer"]
    optimizer.load_state_dict({"state": {i: saved["state"][name] for i, name in enumerate(names)},
                               "param_groups": [dict(saved["param_groups"][0], params=list(range(len(names))))]})
    assert_third_step_continues(bare, optimizer, batches(4)[2], continued)


def assert_third_step_continues(bare, optimizer, batch, continued):
    """One process's step on the whole batch from a checkpoint's state lands where the sharded run's third step did."""
    take_steps(bare, optimizer, [batch], slice(None))
    for name, value in bare.named_parameters():
        torch.testing.assert_close(value, continued[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"bare {name}: {m}")


def dcp_save_after_two_steps(rank, world, directory):
    """3 ranks at stage 3: two Adam steps, then torch.distributed.checkpoint saves each rank's pieces of the model and
    of the optimizer state, nothing gathered; the third step's result returned."""
    import torch.distributed.checkpoint as dcp

    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    model = torchpar.ShardedDataParallel(build(), stage=3)
    optimizer = torchpar.ShardedOptimizer(model, torch.optim.Adam, lr=0.01)
    steps = batches(world)
    take_steps(model, optimizer, steps[:2], mine)
    dcp.save({"model": model.sharded_state_dict(), "optim": optimizer.sharded_state_dict()}, checkpoint_id=directory)
    take_steps(model, optimizer, steps[2:], mine)
    return {key.removeprefix("module."): value for key, value in model.state_dict().items()}


def dcp_resume_at_stage_2(rank, world, directory):
    """The 3-rank checkpoint loaded on this group size into a fresh stage-2 model and optimizer (no state yet), and
    into FSDP2; the third step of the same global batch taken by both."""
    import torch.distributed.checkpoint as dcp

    model = torchpar.ShardedDataParallel(build(), stage=2)
    optimizer = torchpar.ShardedOptimizer(model, torch.optim.Adam, lr=0.5)  # the checkpoint's 0.01 replaces it
    state = {"model": model.sharded_state_dict(), "optim": optimizer.sharded_state_dict()}
    dcp.load(state, checkpoint_id=directory)
    model.load_sharded_state_dict(state["model"])
    optimizer.load_sharded_state_dict(state["optim"])
    mine = slice(rank * 3 * PER_RANK // world, (rank + 1) * 3 * PER_RANK // world)
    take_steps(model, optimizer, batches(3)[2:], mine)
    ours = {name: value.clone() for name, value in model.module.state_dict().items()}
    # The same checkpoint into torch's FSDP2 on these ranks, through torch's own state-dict helpers.
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    theirs = fully_shard(build())
    theirs_optimizer = torch.optim.Adam([p for p in theirs.parameters() if p.requires_grad], lr=0.5)
    model_state, optimizer_state = get_state_dict(theirs, theirs_optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(theirs, theirs_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    take_steps(theirs, theirs_optimizer, batches(3)[2:], mine)
    fsdp2 = {name: value.full_tensor().detach() for name, value in theirs.named_parameters()}
    return ours, fsdp2


def test_a_dcp_checkpoint_of_3_ranks_at_stage_3_resumes_on_2_at_stage_2_in_fsdp2_and_in_a_bare_model(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp

    continued = run_on_ranks(3, dcp_save_after_two_steps, str(tmp_path), deadline_s=180)[0]
    for ours, fsdp2 in run_on_ranks(2, dcp_resume_at_stage_2, str(tmp_path), deadline_s=180):
        for name, value in continued.items():
            torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        for name, value in fsdp2.items():
            torch.testing.assert_close(value, continued[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"FSDP2 {name}: {m}")
    # The checkpoint holds what torch's own state-dict helpers make of a bare model and its Adam: one process loads it.
    bare = build()
    optimizer = torch.optim.Adam([p for p in bare.parameters() if p.requires_grad], lr=0.5)
    model_state, optimizer_state = get_state_dict(bare, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    set_state_dict(bare, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert optimizer.param_groups[0]["lr"] == 0.01
    assert_third_step_continues(bare, optimizer, batches(3)[2], continued)


def load_into_a_wrapped_model(rank, world):
    """A state dict loaded after wrapping (through the wrapper, into its module, or by torch.distributed.checkpoint's
    set_model_state_dict) reaches the shards: the next step starts from the loaded values on every stage."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    (ids, targets), (next_ids, next_targets) = batches(world)[:2]
    torch.manual_seed(5)
    loaded = TiedNet().state_dict()
    expected = build()
    expected.load_state_dict(loaded)
    expected_optimizer = torch.optim.SGD(expected.parameters(), lr=0.1)
    loss_of(expected, next_ids, next_targets).backward()
    expected_optimizer.step()
    for stage in (1, 2, 3):
        for how in ("wrapper", "module", "dcp"):
            context = f"stage {stage}, loaded through the {how}"
            model = torchpar.ShardedDataParallel(build(), stage=stage)
            optimizer = torchpar.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
            optimizer.zero_grad()
            loss_of(model, ids[mine], targets[mine]).backward()
            optimizer.step()
            if how == "wrapper":
                model.load_state_dict({f"module.{name}": value for name, value in loaded.items()})
            elif how == "module":
                model.module.load_state_dict(loaded)
            else:  # DCP's helpers take the inner module (their keys are then a bare model's)
                set_model_state_dict(model.module, loaded)
            optimizer.zero_grad()
            loss_of(model, next_ids[mine], next_targets[mine]).backward()
            optimizer.step()
            full = model.state_dict()
            for name, value in expected.named_parameters():
                torch.testing.assert_close(full[f"module.{name}"], value.detach(), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{context} {name}: {m}")
            if stage == 3:
                assert all(p.untyped_storage().nbytes() == 0 for p in model.module.parameters() if p.requires_grad)
    model = torchpar.ShardedDataParallel(build(), stage=2)  # kept: a dropped wrapper leaves its module plain
    with pytest.raises(ValueError, match="assign=True"):
        model.module.load_state_dict(loaded, assign=True)
    return True


def test_a_state_dict_loaded_after_wrapping_reaches_the_shards():
    assert run_on_ranks(2, load_into_a_wrapped_model, deadline_s=180) == [True, True]


def mixed_precision_against_fsdp2(rank, world, stage):
    """bf16 compute, fp32 master and reduction: the same arithmetic as torch's FSDP2 with the same policy (stage 3:
    each Linear a unit, resharded after forward, as each is a fully_shard unit)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 13), nn.GELU(), nn.Linear(13, 3))

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = torchpar.ShardedDataParallel(mlp(), stage=stage, mp_policy=policy,
                                        units=["0", "2", "4"] if stage == 3 else None)
    assert all(p.dtype == torch.bfloat16 for p in ours.module.parameters())
    assert all(s.dtype == torch.float32 for s in ours.shard_parameters())
    ours_optimizer = torchpar.ShardedOptimizer(ours, torch.optim.Adam, lr=0.01)
    theirs = mlp()
    for layer in theirs:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy, reshard_after_forward=stage == 3)
    fully_shard(theirs, mp_policy=policy, reshard_after_forward=stage == 3)
    theirs_optimizer = torch.optim.Adam(theirs.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(3 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(PER_RANK, 7, generator=generator), torch.randint(0, 3, (PER_RANK,), generator=generator)
        for model, optimizer in ((ours, ours_optimizer), (theirs, theirs_optimizer)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x).float(), y).backward()
            optimizer.step()
    coordinator = ours._coordinator
    masters = {coordinator.parameter_names[i]: whole
               for index, shard in enumerate(coordinator.shard) for i, whole in coordinator.gather_full(index, shard)}
    for name, parameter in theirs.named_parameters():
        expected = parameter.full_tensor().detach()
        torch.testing.assert_close(masters[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"master {name}: {m}")
        if stage == 2:  # stage 3's parameters hold no values between steps
            assert torch.equal(dict(ours.module.named_parameters())[name], expected.to(torch.bfloat16)), name
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_mixed_precision_policy_equals_fsdp2_with_the_same_policy(stage):
    assert run_on_ranks(2, mixed_precision_against_fsdp2, stage, deadline_s=180) == [True, True]


def stage_3(rank, world):
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for reshard_after_forward in (True, False):
        for optimizer_name, (optimizer_class, defaults) in OPTIMIZERS.items():
            context = f"stage 3 {optimizer_name} reshard_after_forward={reshard_after_forward} on {world} ranks"
            context += " prefetching" if optimizer_name == "adam" else ""
            # Units: `hidden` and `out`; the tied embed/decoder and the frozen layer stay in the root.
            prefetch = True if optimizer_name == "adam" else None  # None: the default, off for CPU parameters
            model = torchpar.ShardedDataParallel(build(), stage=3, units=["hidden", "out"],
                                                 reshard_after_forward=reshard_after_forward, prefetch=prefetch)
            optimizer = torchpar.ShardedOptimizer(model, optimizer_class, **defaults)
            unit_parameters = list(model.module.hidden.parameters()) + list(model.module.out.parameters())
            # Prefetching, `out`'s gather is under way (its storage there) while `hidden` computes; else not yet.
            out_storage_during_hidden = []
            model.module.hidden.register_forward_hook(
                lambda *_: out_storage_during_hidden.append(model.module.out.bias.untyped_storage().nbytes() > 0))
            # Between steps a rank holds no unit's parameters, only its shard.
            assert all(p.untyped_storage().nbytes() == 0 for p in model.module.parameters() if p.requires_grad)
            for ids, targets in batches(world):
                optimizer.zero_grad()
                logits = model(ids[mine])
                if reshard_after_forward:  # freed after their forward: the autograd graph's copies hold nothing
                    assert all(p.untyped_storage().nbytes() == 0 for p in unit_parameters), context
                nn.functional.cross_entropy(logits, targets[mine]).backward()
                assert all(p.grad is None for p in model.module.parameters()), context
                assert all(p.untyped_storage().nbytes() == 0 for p in unit_parameters), context
                optimizer.step()
                # Gathered forward (and, resharded, again for backward) plus one reduce-scatter: up to 1.5x DDP's.
                reduce_scatter = model._coordinator.reduce_scatter_bytes
                assert 2 * reduce_scatter <= model.bytes_sent_last_step <= 3 * reduce_scatter, context
            assert out_storage_during_hidden == [bool(prefetch)] * len(batches(world)), context
            full = model.state_dict()
            reference = one_process(optimizer_name, world)
            for name, expected in reference.named_parameters():
                torch.testing.assert_close(full[f"module.{name}"], expected.detach(), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{context} {name}: {m}")
            # unshard() gathers every unit to read the parameters in place (FSDP2's name), reshard() frees them.
            model.unshard()
            for name, expected in reference.named_parameters():
                torch.testing.assert_close(model.module.get_parameter(name).detach(), expected.detach(), rtol=1e-5,
                                           atol=1e-6, msg=lambda m: f"{context} unshard() {name}: {m}")
            model.reshard()
            assert all(p.untyped_storage().nbytes() == 0 for p in unit_parameters), context
            # Read outside its window, a parameter is refused by name (it would be a read through a null
            # pointer); its metadata and gradient stay readable (what libraries ask of a model between steps).
            weight = model.module.hidden.weight
            assert (weight.shape, weight.device, weight.requires_grad, weight.grad) == ((13, 6), torch.device("cpu"),
                                                                                      True, None)
            refused = rf"parameter 'hidden.weight' \(unit 'hidden'\) read \({{}}\) on rank {rank} .* unshard\(\)"
            for what, read in [("sum", lambda: weight.sum()), ("data", lambda: weight.data),
                               ("linear", lambda: nn.functional.linear(torch.ones(6), weight)),
                               ("cat", lambda: torch.cat([weight, weight]))]:
                with pytest.raises(RuntimeError, match=refused.format(what)):
                    read()
            with pytest.raises(RuntimeError, match=r"'embed.weight' \(the root unit"):
                model.module.state_dict()
    with pytest.raises(ValueError, match="no submodule 'hiden'"):
        torchpar.ShardedDataParallel(build(), stage=3, units=["hiden"])
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_stage_3_trains_as_one_process_holding_only_its_shard_between_units(world):
    assert run_on_ranks(world, stage_3, deadline_s=300) == [True] * world


def freed_when_dropped(rank, world):
    """Dropping the wrapper and its optimizer frees them and the model at once, no garbage collection needed: a
    cycle through the module's hooks kept the process group and Gloo's worker threads alive until finalization,
    where they abort the process (torchpar.clean_exit). Those threads are what clean_exit looks for."""
    import gc
    import weakref

    from torchpar.clean_exit import gloo_workers_alive
    ids, targets = batches(world)[0]
    gc.disable()
    try:
        for stage, units in [(1, None), (2, None), (3, ["hidden", "out"])]:
            net = build()
            model = torchpar.ShardedDataParallel(net, stage=stage, units=units)
            optimizer = torchpar.ShardedOptimizer(model, torch.optim.Adam, lr=0.01)
            nn.functional.cross_entropy(model(ids[:PER_RANK]), targets[:PER_RANK]).backward()
            optimizer.step()
            assert gloo_workers_alive()  # started by the group's first collective
            alive = [weakref.ref(model), weakref.ref(optimizer), weakref.ref(net)]
            del model, optimizer, net
            assert [ref() is None for ref in alive] == [True] * 3, f"stage {stage}"
    finally:
        gc.enable()
    return True


def test_the_wrapper_is_freed_when_dropped_and_gloo_workers_are_seen():
    assert run_on_ranks(2, freed_when_dropped, deadline_s=120) == [True, True]


def die_before_a_gather(rank, world, where):
    """Rank 1 exits just before unit `out` is gathered, for its forward or for its backward; rank 0 waits in
    that all-gather and must fail within the group's timeout, naming the unit and the rank that is gone."""
    model = torchpar.ShardedDataParallel(build(), stage=3, units=["hidden", "out"])
    ids, targets = batches(world)[0]
    if rank == 1 and where == "forward":  # prepended: before the wrapper's own hook gathers the unit
        model.module.out.register_forward_pre_hook(lambda *_: os._exit(3), prepend=True)
    start = time.monotonic()
    try:
        logits = model(ids[:PER_RANK])
        if rank == 1 and where == "backward":
            logits.register_hook(lambda grad: os._exit(3))  # the loss's gradient arrives before `out` is gathered
        nn.functional.cross_entropy(logits, targets[:PER_RANK]).backward()
    except RuntimeError as error:
        return str(error), time.monotonic() - start
    raise AssertionError(f"a step succeeded although rank 1 died before a {where} gather")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_rank_dying_before_a_gather_gives_the_others_a_clear_error_within_the_timeout(where):
    outcomes = launch_ranks(2, die_before_a_gather, where, deadline_s=60, collective_timeout_s=10, grace_s=30)
    assert not outcomes[1].passed and "exited with code 3" in outcomes[1].message
    assert outcomes[0].passed, outcomes[0].message
    message, seconds = outcomes[0].value
    assert "ShardedDataParallel (rank 0): the all-gather of unit 'out' failed" in message, message
    assert "rank 1" in message and "has exited" in message, message
    assert seconds < 15, f"the error took {seconds:.1f} s, past the 10 s timeout"


def stages_over_the_grids_data_axis(rank, world):
    """2 data replicas x tensor size 2: a tensor-parallel transformer block sharded over the grid's data group at
    each stage trains as the single-process block on the global batch (float64, SGD)."""
    import torch.nn.functional as F

    import torchpar.tensor_parallel as tp
    from tp_transformer import Block

    torch.set_default_dtype(torch.float64)
    width, heads, hidden, seq, batch, steps = 8, 4, 16, 6, 4, 2
    grid = torchpar.ParallelGrid(data=2, tensor=2)
    generator = torch.Generator().manual_seed(50)
    data = [(torch.randn(batch, seq, width, generator=generator), torch.randn(batch, seq, width, generator=generator))
            for _ in range(steps)]
    reference = Block(width, heads, hidden)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in data:
        reference_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
    replica = slice(grid.data_index * batch // 2, (grid.data_index + 1) * batch // 2)
    for stage in (1, 2, 3):
        model = torchpar.ShardedDataParallel(Block(width, heads, hidden, group=grid.tensor_group), stage=stage,
                                             process_group=grid.data_group)
        optimizer = torchpar.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
        for x, y in data:
            optimizer.zero_grad()
            F.mse_loss(model(x[replica]), y[replica]).backward()
            optimizer.step()
        model.unshard()
        full = tp.full_state_dict(model.module, grid.tensor_group)
        model.reshard()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=1e-9, atol=1e-9,
                                       msg=lambda m: f"stage {stage} on the grid's data axis, {name}: {m}")
    return True


def test_stages_compose_with_tensor_parallelism_on_the_grids_data_axis():
    assert run_on_ranks(4, stages_over_the_grids_data_axis, deadline_s=240) == [True] * 4


def zero_over_pipeline_replicas(rank, world, stage):
    """2 pipeline stages x 2 replicas: each stage's replicas shard its optimizer state (and gradients) over the grid's
    data group, the pipeline's micro-batch gradients reduce-scattered after its step (reduce_gradients); training
    equals one process on the global batch (Adam)."""
    import torchpar.pipeline

    grid = torchpar.ParallelGrid(data=2, pipeline=2)
    layers = [lambda i=i: (torch.manual_seed(i), nn.Sequential(nn.Linear(6, 6), nn.Tanh()))[1] for i in range(4)]
    pipe = torchpar.pipeline.Pipeline(layers, nn.functional.mse_loss, schedule="1f1b", microbatches=2,
                                      balance=[2, 2], process_group=grid.pipeline_group)
    model = torchpar.ShardedDataParallel(pipe.stage_modules, stage=stage, process_group=grid.data_group)
    optimizer = torchpar.ShardedOptimizer(model, torch.optim.Adam, lr=0.01)
    reference = nn.Sequential(*[factory() for factory in layers])
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(9)
    replica = slice(grid.data_index * 4, (grid.data_index + 1) * 4)
    for _ in range(STEPS):
        x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 6, generator=generator)
        optimizer.zero_grad()
        pipe.step(x[replica], y[replica])
        model.reduce_gradients()
        optimizer.step()
        reference_optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
    expected = dict(reference.named_parameters())
    for name, value in model.module.named_parameters():  # "<stage>.<layer in stage>.<index in layer>.<tensor>"
        stage_index, layer, rest = name.split(".", 2)
        global_name = f"{2 * int(stage_index) + int(layer)}.{rest}"
        torch.testing.assert_close(value, expected[global_name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"stage {stage} over the pipeline's replicas, {global_name}: {m}")
    return True


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_shard_each_pipeline_stages_replicas(stage):
    assert run_on_ranks(4, zero_over_pipeline_replicas, stage, deadline_s=240) == [True] * 4


def peak_allocated(rank, world, variant):
    """The most this rank's CPU tensors took (the allocator's count, from before the model was built) over three
    Adam steps of an MLP of nine Linear units, and its parameter bytes."""
    from torchpar import allocator

    allocator.count_cpu_allocations()
    torch.manual_seed(0)
    module = nn.Sequential(*[layer for _ in range(8) for layer in (nn.Linear(256, 256), nn.Tanh())], nn.Linear(256, 4))
    x, y = torch.randn(8, 256), torch.randint(0, 4, (8,))
    allocator.reset_cpu_peak_memory()
    before = allocator.cpu_memory_allocated()
    if variant == "ddp":
        model = torchpar.DistributedDataParallel(module)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        model = torchpar.ShardedDataParallel(module, stage=3)
        optimizer = torchpar.ShardedOptimizer(model, torch.optim.Adam, lr=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return allocator.cpu_max_memory_allocated() - before, sum(p.numel() * 4 for p in module.parameters())


def test_stage_3s_peak_is_below_ddps_by_the_formulas_margin_on_4_ranks():
    """ZeRO's model state: DDP 16 bytes per parameter (fp32 parameters, gradients, Adam's two moments), stage 3 16/N.
    Measured peaks, transients included (buckets, gathered units, activations), must differ by at least that."""
    ddp = run_on_ranks(4, peak_allocated, "ddp", deadline_s=120)
    stage_3 = run_on_ranks(4, peak_allocated, "stage 3", deadline_s=120)
    parameter_bytes = ddp[0][1]
    margin = 4 * parameter_bytes * (1 - 1 / 4)
    assert min(peak for peak, _ in ddp) - max(peak for peak, _ in stage_3) >= margin, (ddp, stage_3, margin)
