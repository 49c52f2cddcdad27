"""Pipeline features beyond the schedules: tuples and variable shapes between stages, pipeline x
data parallelism, recomputation with dropout, balancing by measured time, where the loss appears."""
import copy
import time

import torch
import torch.distributed as dist
from torch import nn

from pipeline_reference import assert_matches_reference, batch, deep_mlp, reference_gradients
from rank_harness import run_on_ranks

import torchpar.pipeline
import torchpar.same_host

WIDTH, CLASSES = 8, 3


class TokenMix(nn.Module):
    """(hidden [B, T, D], lengths [B] int64) -> the same, mixed per token: an integer tensor rides along."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden, lengths):
        return torch.tanh(self.linear(hidden)), lengths


class TrimToLongest(nn.Module):
    """Drops padding beyond the longest sequence: micro-batches of one step leave with different shapes."""

    def forward(self, hidden, lengths):
        return hidden[:, : int(lengths.max())], lengths


class MaskedMean(nn.Module):
    def forward(self, hidden, lengths):
        mask = (torch.arange(hidden.shape[1])[None, :] < lengths[:, None]).to(hidden.dtype)
        return (hidden * mask[..., None]).sum(1) / lengths[:, None].to(hidden.dtype)


def sequence_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [TokenMix(), TrimToLongest(), TokenMix(), TokenMix(), MaskedMean(), nn.Linear(WIDTH, CLASSES)]


def sequence_reference(layers, hidden, lengths, target):
    layers = copy.deepcopy(layers)
    value = (hidden, lengths)
    for layer in layers:
        value = layer(*value) if isinstance(value, tuple) else layer(value)
    loss = nn.functional.cross_entropy(value, target)
    loss.backward()
    grads = {f"{i}.{name}": p.grad for i, layer in enumerate(layers) for name, p in layer.named_parameters()}
    return loss.detach(), grads


def train_variable_lengths(rank, world, schedule):
    layers = sequence_layers()
    pipe = torchpar.pipeline.Pipeline(copy.deepcopy(layers), nn.functional.cross_entropy, schedule=schedule,
                                      microbatches=4)
    reference_model = nn.Sequential(*layers)  # only for parameter names
    seen = []
    for step, tokens in enumerate([5, 9, 3, 9]):
        generator = torch.Generator().manual_seed(step)
        hidden = torch.randn(8, tokens, WIDTH, generator=generator)
        lengths = torch.randint(1, tokens + 1, (8,), generator=generator)
        target = torch.randint(0, CLASSES, (8,), generator=generator)
        expected_loss, expected_grads = sequence_reference(layers, hidden, lengths, target)
        for parameter in pipe.parameters():
            parameter.grad = None
        loss = pipe.step((hidden, lengths) if pipe.is_first_stage else None, target if pipe.is_last_stage else None)
        assert_matches_reference(pipe, reference_model, loss, expected_loss, expected_grads)
        seen.append(tokens)
    return seen


def test_shapes_change_between_steps_and_micro_batches_and_integer_tensors_ride_along():
    for schedule in ("1f1b", "zero_bubble"):
        assert run_on_ranks(2, train_variable_lengths, schedule)[0] == [5, 9, 3, 9]


def train_hybrid(rank, world):
    model = deep_mlp()
    pipeline_group, data_parallel_group = torchpar.pipeline.hybrid_groups(stages=2)
    replica = rank // 2
    local = copy.deepcopy(model)
    if replica == 1:  # replicas start apart; the pipeline must begin from replica 0's weights
        with torch.no_grad():
            for parameter in local.parameters():
                parameter.add_(1.0)
    pipe = torchpar.pipeline.Pipeline(local, nn.functional.cross_entropy, schedule="1f1b", microbatches=2,
                                      process_group=pipeline_group, data_parallel_group=data_parallel_group)
    inputs, target = batch(16)
    expected_loss, expected_grads = reference_gradients(model, inputs, target)
    half_loss, _ = reference_gradients(model, inputs[replica * 8:(replica + 1) * 8], target[replica * 8:(replica + 1) * 8])
    share = slice(replica * 8, (replica + 1) * 8)
    # The replicas share this host: their gradient averages go through an shm group beside the Gloo one.
    shm_group = torchpar.same_host.shm_group_beside(data_parallel_group, torch.device("cpu"))
    assert dist.get_backend(shm_group) == "shm"
    ops_before = shm_group._get_backend(torch.device("cpu"))._get_sequence_number_for_group()
    loss = pipe.step(inputs[share], target[share])
    averages = shm_group._get_backend(torch.device("cpu"))._get_sequence_number_for_group() - ops_before
    # Each replica's loss is its own half's; the gradients are the whole batch's once averaged.
    assert_matches_reference(pipe, model, loss, half_loss, expected_grads)
    return pipe.stages, averages


def test_two_replicas_of_two_stages_equal_single_process_training():
    results = run_on_ranks(4, train_hybrid, deadline_s=120)
    assert [stages for stages, _ in results] == [[0], [1], [0], [1]]
    assert all(averages == 1 for _, averages in results), results  # each stage's gradients: one bucket


class NoisyMlp(nn.Sequential):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__(nn.Linear(12, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.3),
                         nn.Tanh(), nn.Linear(16, 5))


def gradients_with_dropout(rank, world, checkpoint):
    pipe = torchpar.pipeline.Pipeline(NoisyMlp(), nn.functional.cross_entropy, schedule="1f1b", microbatches=4,
                                      checkpoint=checkpoint)
    inputs, target = batch(16)
    torch.manual_seed(100 + rank)
    pipe.step(inputs, target)
    return [p.grad.clone() for p in pipe.parameters()]


def test_recomputation_replays_dropout_exactly():
    plain = run_on_ranks(2, gradients_with_dropout, False)
    recomputed = run_on_ranks(2, gradients_with_dropout, True)
    for rank in range(2):
        assert len(plain[rank]) == len(recomputed[rank]) > 0
        for a, b in zip(plain[rank], recomputed[rank]):
            assert torch.equal(a, b)


class Slow(nn.Module):
    def forward(self, x):
        time.sleep(0.01)
        return x


def balance_by_time(rank, world):
    torch.manual_seed(0)
    layers = [nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), Slow(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 5)]
    pipe = torchpar.pipeline.Pipeline(layers, nn.functional.cross_entropy, microbatches=3, balance="time",
                                      sample_input=torch.randn(4, 12))
    return pipe.balance, pipe.partition_report


def test_balance_by_measured_time_puts_the_slow_layer_alone():
    # Whatever the cheap layers measure, adding any of them to the 10 ms layer's stage makes the
    # slowest stage slower: alone is the only optimum.
    balance, report = run_on_ranks(3, balance_by_time)[2]
    assert balance == [3, 1, 3], report
    assert "stage 1: layers 3-3 (1 layer), predicted" in report and " ms" in report


def balance_replicas_by_time(rank, world):
    pipeline_group, data_parallel_group = torchpar.pipeline.hybrid_groups(stages=2)
    torch.manual_seed(0)
    layers = [nn.Linear(12, 12) for _ in range(5)]
    pipe = torchpar.pipeline.Pipeline(layers, nn.functional.mse_loss, microbatches=2, balance="time",
                                      sample_input=torch.randn(4, 12), process_group=pipeline_group,
                                      data_parallel_group=data_parallel_group)
    return pipe.balance


def test_replicas_adopt_replica_zeros_measured_partition():
    # Five equal layers measure slightly differently on each replica's first rank; a replica cutting
    # the model its own way would break the gradient averaging.
    balances = run_on_ranks(4, balance_replicas_by_time)
    assert all(balance == balances[0] for balance in balances), balances


def loss_only_on_last(rank, world):
    pipe = torchpar.pipeline.Pipeline(deep_mlp(), nn.functional.cross_entropy, microbatches=2, loss_on="last")
    inputs, target = batch(8)
    return pipe.step(inputs, target)


def test_loss_on_last_returns_none_elsewhere():
    losses = run_on_ranks(2, loss_only_on_last)
    assert losses[0] is None and losses[1] is not None and losses[1].dim() == 0


def equivalence_on_shm(rank, world):
    model = deep_mlp()
    inputs, target = batch(12)
    expected_loss, expected_grads = reference_gradients(model, inputs, target)
    pipe = torchpar.pipeline.Pipeline(copy.deepcopy(model), nn.functional.cross_entropy, microbatches=3)
    loss = pipe.step(inputs, target)
    return assert_matches_reference(pipe, model, loss, expected_loss, expected_grads)


def test_pipeline_runs_on_the_shared_memory_backend():
    names = run_on_ranks(2, equivalence_on_shm, backend="shm")
    assert set(names[0]) | set(names[1]) == {name for name, _ in deep_mlp().named_parameters()}


def recorded_timeline(rank, world):
    pipe = torchpar.pipeline.Pipeline(deep_mlp(), nn.functional.cross_entropy, schedule="zero_bubble", microbatches=3)
    inputs, target = batch(12)
    pipe.step(inputs, target)
    return [(str(t.action.type).rsplit(".", 1)[-1], t.action.microbatch, t.start, t.end) for t in pipe.last_step_timeline], \
        pipe.last_step_milliseconds, pipe.last_step_waiting_milliseconds, [repr(a) for a in pipe.actions if a.is_compute]


def test_the_last_step_timeline_records_each_compute_action_in_order():
    for rank, (timeline, milliseconds, waiting, planned) in enumerate(run_on_ranks(2, recorded_timeline)):
        assert [f"{kind}{mb}" for kind, mb, _, _ in timeline] == [action.split("@")[0] for action in planned]
        assert len(timeline) == 9  # F, I and W for each of 3 micro-batches
        ends = 0.0
        for _, _, start, end in timeline:
            assert ends <= start <= end <= milliseconds
            ends = end
        # Waiting for transfers happens between compute actions: the two never overlap. Rank 1 waits at least
        # for its first activation, which rank 0 sends only after its first forward.
        compute = sum(end - start for _, _, start, end in timeline)
        assert 0 <= waiting and compute + waiting <= milliseconds
        if rank == 1:
            assert waiting > 0


SLOW_FORWARD_S = 0.05


class SlowForward(nn.Module):
    """The identity, after a sleep: a first stage that keeps the next one waiting."""

    def forward(self, x):
        time.sleep(SLOW_FORWARD_S)
        return x


def step_behind_a_slow_stage(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(SlowForward(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))
    pipe = torchpar.pipeline.Pipeline(model, nn.functional.cross_entropy, schedule="gpipe", microbatches=3,
                                      balance=[2, 2])
    inputs, target = batch(12)
    pipe.step(inputs, target)
    compute = sum(t.end - t.start for t in pipe.last_step_timeline)
    return pipe.last_step_milliseconds, pipe.last_step_waiting_milliseconds, compute


def test_waiting_behind_a_slow_stage_counts_as_waiting_not_host_work():
    # GPipe's last stage posts micro-batch k + 1's receive before running k, and that post waits for k's
    # shapes: time the pipeline must count as waiting, or the simulator is taught host work that is not there.
    step_ms, waiting_ms, compute_ms = run_on_ranks(2, step_behind_a_slow_stage)[1]
    assert waiting_ms >= 0.8 * 3 * SLOW_FORWARD_S * 1e3, (step_ms, waiting_ms, compute_ms)
    assert step_ms - waiting_ms - compute_ms < 0.2 * step_ms, (step_ms, waiting_ms, compute_ms)


def in_place_first_layers(rank, world, schedule, checkpoint):
    torch.manual_seed(0)
    # Stage 1 (and, with split backward, every layer) starts with an in-place op on its input.
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True),
                          nn.Linear(16, 5))
    inputs, target = batch(8)
    expected_loss, expected_grads = reference_gradients(model, inputs, target)
    pipe = torchpar.pipeline.Pipeline(copy.deepcopy(model), nn.functional.cross_entropy, schedule=schedule,
                                      microbatches=2, balance=[1, 4], checkpoint=checkpoint)
    for _ in range(2):
        for parameter in pipe.parameters():
            parameter.grad = None
        loss = pipe.step(inputs, target)
        assert_matches_reference(pipe, model, loss, expected_loss, expected_grads)
    return True


def test_layers_that_change_their_input_in_place():
    for schedule, checkpoint in (("1f1b", False), ("zero_bubble", False), ("1f1b", True)):
        assert run_on_ranks(2, in_place_first_layers, schedule, checkpoint) == [True, True]


def test_plain_linear_layers_run_as_the_engines_own_and_hooked_ones_as_modules():
    assert torchpar.pipeline._plain_linear(nn.Linear(4, 4))
    hooked = nn.Linear(4, 4)
    hooked.register_forward_hook(lambda module, args, output: output)
    assert not torchpar.pipeline._plain_linear(hooked)
    assert not torchpar.pipeline._plain_linear(nn.modules.linear.NonDynamicallyQuantizableLinear(4, 4))


def hooked_gradients(rank, world, schedule):
    """A tensor hook doubling one weight's gradient and post-accumulate hooks counting on every weight."""
    model = deep_mlp()
    weights = [module.weight for module in model if isinstance(module, nn.Linear)]

    def hook_all(parameters, counts):
        parameters[0].register_hook(lambda gradient: gradient * 2)
        for index, weight in enumerate(parameters):
            weight.register_post_accumulate_grad_hook(lambda _, index=index: counts.__setitem__(index, counts[index] + 1))

    reference = copy.deepcopy(model)
    reference_counts = [0] * len(weights)
    hook_all([module.weight for module in reference if isinstance(module, nn.Linear)], reference_counts)
    inputs, target = batch(16)
    expected_loss = nn.functional.cross_entropy(reference(inputs), target)  # reference_gradients' copy would drop the hooks
    expected_loss.backward()
    expected_grads = {name: parameter.grad for name, parameter in reference.named_parameters()}
    assert reference_counts == [1] * len(weights)

    counts = [0] * len(weights)
    hook_all(weights, counts)
    pipe = torchpar.pipeline.Pipeline(model, nn.functional.cross_entropy, schedule=schedule, microbatches=4)
    loss = pipe.step(inputs, target)
    assert_matches_reference(pipe, model, loss, expected_loss, expected_grads)
    own = {id(parameter) for parameter in pipe.parameters()}
    return [count for weight, count in zip(weights, counts) if id(weight) in own]


def test_hooks_on_linear_weights_see_each_micro_batchs_gradient_as_under_autograd():
    for schedule in ("1f1b", "zero_bubble"):
        counts = run_on_ranks(2, hooked_gradients, schedule)
        assert sum(map(len, counts)) == 5 and all(count == 4 for rank in counts for count in rank), (schedule, counts)
