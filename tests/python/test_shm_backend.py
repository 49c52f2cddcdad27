"""torchpar's "shm" backend on real ranks, against Gloo's results for the same calls."""
import datetime
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from rank_harness import launch_ranks, run_on_ranks

REDUCIBLE = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16, torch.int32,
             torch.int64, torch.bool]
MOVABLE = [torch.float32, torch.bfloat16, torch.int8, torch.int64, torch.bool]
SIZES = [0, 1, 10007]  # empty, one element, a prime
HALF = (torch.float16, torch.bfloat16)
BIG = 16 * 1024 * 1024  # float32 elements: 64 MiB


def contribution(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integer values: sums are exact in every dtype, products stay small."""
    values = (torch.arange(numel) * 7 + rank * 3) % 5 + 1
    if dtype == torch.bool:
        return (values % 2).bool()
    return values.to(dtype)


def reduce_ops(dtype):
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
    if not dtype.is_floating_point:
        ops += [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]
    return ops


def assert_same(ours, reference, context):
    if ours.dtype in HALF:
        torch.testing.assert_close(ours.float(), reference.float(), rtol=1e-2, atol=0, msg=lambda m: f"{context}: {m}")
    else:
        assert torch.equal(ours, reference), f"{context}: shm {ours.flatten()[:8]} != gloo {reference.flatten()[:8]}"


def both(call, shm, gloo):
    """The same call on the shm group and on the Gloo group; returns the two results."""
    return call(shm), call(gloo)


def gloo_supports(call, gloo) -> bool:
    try:
        call(gloo)
        return True
    except (RuntimeError, ValueError):
        return False


def every_op_matches_gloo(rank, world):
    shm = dist.new_group(backend="shm")
    gloo = dist.group.WORLD
    root = world - 1

    for dtype in REDUCIBLE:
        for numel in SIZES:
            for op in reduce_ops(dtype):
                def allreduce(group):
                    tensor = contribution(rank, numel, dtype)
                    dist.all_reduce(tensor, op=op, group=group)
                    return tensor
                if not gloo_supports(allreduce, gloo):
                    continue
                assert_same(*both(allreduce, shm, gloo), f"allreduce {op} {dtype} x{numel}")

            def reduce(group):
                tensor = contribution(rank, numel, dtype)
                dist.reduce(tensor, dst=root, group=group)
                return tensor
            if gloo_supports(reduce, gloo):
                ours, reference = both(reduce, shm, gloo)
                if rank == root:
                    assert_same(ours, reference, f"reduce {dtype} x{numel}")

            def reduce_scatter(group):
                output = torch.empty(numel, dtype=dtype)
                dist.reduce_scatter_tensor(output, contribution(rank, numel * world, dtype), group=group)
                return output
            if gloo_supports(reduce_scatter, gloo):
                assert_same(*both(reduce_scatter, shm, gloo), f"reduce_scatter_tensor {dtype} x{numel}")

        if dtype.is_floating_point:
            summed = contribution(rank, 1000, dtype)
            dist.all_reduce(summed, op=dist.ReduceOp.AVG, group=shm)
            expected = sum(contribution(r, 1000, torch.float64) for r in range(world)) / world
            torch.testing.assert_close(summed.double(), expected, rtol=1e-2 if dtype in HALF else 1e-6, atol=0)
        elif dtype != torch.bool:
            # As NCCL (Lightning averages its int64 counters so): the sum divided, truncated toward zero;
            # signed types get negative values whose truncation differs from flooring.
            def signed(r):
                values = contribution(r, 1000, torch.int64)
                return values if dtype == torch.uint8 else values - 3 * r
            averaged = signed(rank).to(dtype)
            dist.all_reduce(averaged, op=dist.ReduceOp.AVG, group=shm)
            expected = torch.div(sum(signed(r) for r in range(world)), world, rounding_mode="trunc").to(dtype)
            assert torch.equal(averaged, expected), f"AVG {dtype}: {averaged[:8]} != {expected[:8]}"

    for dtype in MOVABLE:
        for numel in SIZES:
            def broadcast(group):
                tensor = contribution(rank, numel, dtype)
                dist.broadcast(tensor, src=root, group=group)
                return tensor
            assert_same(*both(broadcast, shm, gloo), f"broadcast {dtype} x{numel}")

            def all_gather(group):
                outputs = [torch.empty(numel, dtype=dtype) for _ in range(world)]
                dist.all_gather(outputs, contribution(rank, numel, dtype), group=group)
                return torch.cat(outputs)
            assert_same(*both(all_gather, shm, gloo), f"all_gather {dtype} x{numel}")

            def all_gather_into_tensor(group):
                output = torch.empty(numel * world, dtype=dtype)
                dist.all_gather_into_tensor(output, contribution(rank, numel, dtype), group=group)
                return output
            assert_same(*both(all_gather_into_tensor, shm, gloo), f"all_gather_into_tensor {dtype} x{numel}")

            def gather(group):
                outputs = [torch.empty(numel, dtype=dtype) for _ in range(world)] if rank == root else None
                dist.gather(contribution(rank, numel, dtype), outputs, dst=root, group=group)
                return torch.cat(outputs) if rank == root else torch.empty(0, dtype=dtype)
            assert_same(*both(gather, shm, gloo), f"gather {dtype} x{numel}")

            def scatter(group):
                output = torch.empty(numel, dtype=dtype)
                inputs = [contribution(r + 10, numel, dtype) for r in range(world)] if rank == root else None
                dist.scatter(output, inputs, src=root, group=group)
                return output
            assert_same(*both(scatter, shm, gloo), f"scatter {dtype} x{numel}")

            def all_to_all_even(group):
                output = torch.empty(numel * world, dtype=dtype)
                dist.all_to_all_single(output, contribution(rank, numel * world, dtype), group=group)
                return output
            assert_same(*both(all_to_all_even, shm, gloo), f"all_to_all_single {dtype} x{numel}")

        def all_to_all_with(rows):
            """rows(source, destination): how many rows of 2 one rank sends another."""
            def call(group):
                sends = [rows(rank, d) for d in range(world)]
                receives = [rows(s, rank) for s in range(world)]
                source = contribution(rank, sum(sends) * 2, dtype).view(-1, 2)
                output = torch.empty(sum(receives), 2, dtype=dtype)
                dist.all_to_all_single(output, source, receives, sends, group=group)
                return output
            return call

        uneven = all_to_all_with(lambda s, d: s + d + 1)
        assert_same(*both(uneven, shm, gloo), f"all_to_all_single uneven {dtype}")
        rank0_sends_nothing = all_to_all_with(lambda s, d: 0 if s == 0 else d + 1)
        assert_same(*both(rank0_sends_nothing, shm, gloo), f"all_to_all_single, empty rank {dtype}")

        def all_to_all_lists(group):
            inputs = [contribution(rank * world + d, d + 2, dtype) for d in range(world)]
            outputs = [torch.empty(rank + 2, dtype=dtype) for _ in range(world)]
            dist.all_to_all(outputs, inputs, group=group)
            return torch.cat(outputs)
        if gloo_supports(all_to_all_lists, gloo):
            assert_same(*both(all_to_all_lists, shm, gloo), f"all_to_all {dtype}")

    # 64 MiB per rank: many chunks, both buffer sets, the partitioned reduction.
    def big_allreduce(group):
        tensor = contribution(rank, BIG, torch.float32)
        dist.all_reduce(tensor, group=group)
        return tensor

    def big_reduce(group):
        tensor = contribution(rank, BIG, torch.float32)
        dist.reduce(tensor, dst=root, group=group)
        return tensor if rank == root else torch.empty(0)

    def big_broadcast(group):
        tensor = contribution(rank, BIG, torch.float32)
        dist.broadcast(tensor, src=0, group=group)
        return tensor

    def big_all_gather(group):
        output = torch.empty(BIG * world)
        dist.all_gather_into_tensor(output, contribution(rank, BIG, torch.float32), group=group)
        return output

    def big_reduce_scatter(group):
        output = torch.empty(BIG // world)
        dist.reduce_scatter_tensor(output, contribution(rank, BIG // world * world, torch.float32), group=group)
        return output

    def big_all_to_all(group):
        output = torch.empty(BIG // world * world)
        dist.all_to_all_single(output, contribution(rank, BIG // world * world, torch.float32), group=group)
        return output

    def big_gather(group):
        outputs = [torch.empty(BIG // world) for _ in range(world)] if rank == root else None
        dist.gather(contribution(rank, BIG // world, torch.float32), outputs, dst=root, group=group)
        return torch.cat(outputs) if rank == root else torch.empty(0)

    def big_scatter(group):
        output = torch.empty(BIG // world)
        inputs = [contribution(r, BIG // world, torch.float32) for r in range(world)] if rank == root else None
        dist.scatter(output, inputs, src=root, group=group)
        return output

    for big in (big_allreduce, big_reduce, big_broadcast, big_all_gather, big_reduce_scatter, big_all_to_all,
                big_gather, big_scatter):
        assert_same(*both(big, shm, gloo), f"{big.__name__} (64 MiB)")

    # Non-contiguous tensors (a transposed view) are read and written through their strides.
    def strided(group):
        tensor = contribution(rank, 12 * 7, torch.float32).view(12, 7).t()
        dist.all_reduce(tensor, group=group)
        return tensor
    ours, reference = both(strided, shm, gloo)
    assert not ours.is_contiguous()
    assert_same(ours, reference, "allreduce of a transposed view")

    pg = shm._get_backend(torch.device("cpu"))
    coalesced = [contribution(rank, 5, torch.float32), contribution(rank, 300, torch.float32)]
    pg.allreduce_coalesced(coalesced, dist.AllreduceCoalescedOptions()).wait()
    for tensor, numel in zip(coalesced, (5, 300)):
        assert torch.equal(tensor, sum(contribution(r, numel, torch.float32) for r in range(world)))

    dist.barrier(group=shm)
    if world > 1:  # point-to-point, with tags and from any source
        if rank == 0:
            dist.send(torch.full((4,), 7.0), dst=1, group=shm, tag=3)
        elif rank == 1:
            received = torch.empty(4)
            assert dist.recv(received, group=shm, tag=3) == 0
            assert torch.equal(received, torch.full((4,), 7.0))
    dist.destroy_process_group(shm)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_op_and_dtype_matches_gloo(world):
    assert run_on_ranks(world, every_op_matches_gloo, deadline_s=600) == [True] * world


def concurrent_groups_and_subgroups(rank, world):
    first = dist.new_group(backend="shm")
    second = dist.new_group(backend="shm")
    # Large enough (> 256 KiB) to run on each group's own backend thread, both at once.
    a, b = torch.full((100_000,), float(rank)), torch.full((300_000,), float(rank + 1))
    pending = [dist.all_reduce(a, group=first, async_op=True), dist.all_reduce(b, group=second, async_op=True)]
    for work in pending:
        work.wait()
    assert torch.equal(a, torch.full((100_000,), float(sum(range(world)))))
    assert torch.equal(b, torch.full((300_000,), float(sum(range(1, world + 1)))))
    # A sub-group of the even ranks; the others are not part of it.
    evens = [r for r in range(world) if r % 2 == 0]
    sub = dist.new_group(ranks=evens, backend="shm")
    if rank in evens:
        tensor = torch.full((10,), float(rank))
        dist.all_reduce(tensor, group=sub)
        assert torch.equal(tensor, torch.full((10,), float(sum(evens))))
    # The future of a Work carries the result, as DDP's comm hooks need.
    future = dist.all_reduce(torch.ones(4), group=first, async_op=True).get_future()
    assert torch.equal(future.wait()[0], torch.full((4,), float(world)))
    # Object collectives ride on the tensor collectives.
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank, "name": "x" * rank}, group=first)
    assert objects == [{"rank": r, "name": "x" * r} for r in range(world)]
    shared = [{"config": [1, 2, 3]} if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0, group=first)
    assert shared == [{"config": [1, 2, 3]}]
    for group in (first, second):
        dist.destroy_process_group(group)
    return True


def test_two_groups_at_once_and_subgroups():
    assert run_on_ranks(4, concurrent_groups_and_subgroups) == [True] * 4


def mismatched_calls(rank, world):
    shm = dist.new_group(backend="shm")
    sizes = {0: "40 bytes", 1: "44 bytes"}
    expected = rf"different collectives; this rank: allreduce of float32, {sizes[rank]}, SUM; rank {1 - rank}: " \
               rf"allreduce of float32, {sizes[1 - rank]}, SUM"
    with pytest.raises(dist.DistBackendError, match=expected):
        dist.all_reduce(torch.ones(10 + rank), group=shm)
    with pytest.raises(dist.DistBackendError, match="different collectives"):
        dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64), group=shm)
    # The group stays usable after a detected mismatch.
    tensor = torch.ones(6)
    dist.all_reduce(tensor, group=shm)
    assert torch.equal(tensor, torch.full((6,), float(world)))
    return True


def test_mismatched_calls_fail_on_every_rank_and_leave_the_group_usable():
    assert run_on_ranks(2, mismatched_calls) == [True, True]


def silent_peer(rank, world):
    shm = dist.new_group(backend="shm", timeout=datetime.timedelta(seconds=2))
    if rank == 1:
        time.sleep(6)
        return "slept"
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=r"allreduce #1 on rank 0: Timed out waiting for rank\(s\) 1, which did not take part"):
        dist.all_reduce(torch.ones(8), group=shm)
    assert time.monotonic() - start < 5
    return "raised"


def test_a_silent_peer_is_named_within_the_timeout():
    assert run_on_ranks(2, silent_peer) == ["raised", "slept"]


def silent_barrier_peer(rank, world):
    shm = dist.new_group(backend="shm", timeout=datetime.timedelta(seconds=1))
    if rank == 1:
        time.sleep(3)
        return "slept"
    with pytest.raises(dist.DistBackendError) as raised:
        dist.barrier(group=shm)
    # The phrase Gloo and NCCL use, which torch's own suite and users' retry code match.
    assert re.search(" (Timed out|closed|timeout) ", str(raised.value)), str(raised.value)
    assert "barrier #1 on rank 0: Timed out waiting for rank(s) 1" in str(raised.value)
    return "raised"


def test_a_barrier_timeout_says_timed_out_as_gloo_does():
    assert run_on_ranks(2, silent_barrier_peer) == ["raised", "slept"]


def what_gloo_offers_besides(rank, world):
    shm = dist.new_group(backend="shm", timeout=datetime.timedelta(seconds=20))
    gloo = dist.group.WORLD
    # all_gather_coalesced, with inputs of several shapes (one empty, one not contiguous).
    inputs = [torch.arange(5.0) + rank, torch.full((2, 3), float(rank)), torch.empty(0),
              torch.arange(12.0).view(3, 4).t() * (rank + 1)]
    gathered = {}
    for name, group in (("shm", shm), ("gloo", gloo)):
        outputs = [[torch.empty_like(t) for t in inputs] for _ in range(world)]
        dist.all_gather_coalesced(outputs, inputs, group=group)
        gathered[name] = outputs
    for mine, theirs in zip(gathered["shm"], gathered["gloo"]):
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b)
    # Sparse all-reduce (COO): the sum of every rank's rows, as Gloo computes it.
    indices = torch.tensor([[rank, world]])
    sparse = {name: torch.sparse_coo_tensor(indices, torch.tensor([1.0, rank]), (world + 1,)) for name in ("shm", "gloo")}
    dist.all_reduce(sparse["shm"], group=shm)
    dist.all_reduce(sparse["gloo"], group=gloo)
    assert torch.equal(sparse["shm"].to_dense(), sparse["gloo"].to_dense())
    # Sequence numbers: one per collective, equal on every rank.
    before = shm._get_backend(torch.device("cpu"))._get_sequence_number_for_group()
    dist.all_reduce(torch.ones(1), group=shm)
    dist.barrier(group=shm)
    after = shm._get_backend(torch.device("cpu"))._get_sequence_number_for_group()
    assert after == before + 2
    numbers = [None] * world
    dist.all_gather_object(numbers, after, group=gloo)
    assert numbers == [after] * world
    # Its name, wherever torch reports one.
    assert dist.get_backend(shm) == "shm" and shm._get_backend_name() == "shm"
    # monitored_barrier: passes when all arrive; otherwise rank 0 names the rank that did not.
    dist.monitored_barrier(group=shm, timeout=datetime.timedelta(seconds=10))
    if rank == 0:
        with pytest.raises(RuntimeError, match="Rank 1 failed to pass monitoredBarrier"):
            dist.monitored_barrier(group=shm, timeout=datetime.timedelta(seconds=1))
    dist.barrier(group=gloo)
    return True


def test_what_gloo_offers_besides_the_usual_collectives_works_on_shm():
    assert run_on_ranks(2, what_gloo_offers_besides) == [True, True]


def detail_debug_mode(rank, world):
    # TORCH_DISTRIBUTED_DEBUG=DETAIL: torch checks every collective across ranks before running it.
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    shm = dist.new_group(backend="shm", timeout=datetime.timedelta(seconds=20))
    tensor = torch.full((4,), float(rank))
    dist.all_reduce(tensor, group=shm)
    assert tensor.tolist() == [sum(range(world))] * 4
    model = torch.nn.Linear(3, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=shm)
    ddp(torch.randn(2, 3)).sum().backward()
    assert ddp._get_ddp_logging_data()["backend_name"] == "shm"
    with pytest.raises(RuntimeError, match="Detected mismatch between collectives"):
        dist.all_reduce(torch.ones(3 + rank), group=shm)
    return True


def test_torchs_detail_debug_mode_checks_shm_collectives():
    assert run_on_ranks(2, detail_debug_mode) == [True, True]


def killed_peer(rank, world):
    shm = dist.new_group(backend="shm", timeout=datetime.timedelta(seconds=60))
    dist.all_reduce(torch.ones(8), group=shm)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=r"failed: rank\(s\) 1 \(process \d+\) died before taking part"):
        dist.all_reduce(torch.ones(1 << 20), group=shm)
    assert time.monotonic() - start < 10, "a dead peer must be noticed long before the timeout"
    return "raised"


def test_kill_9_of_a_rank_mid_op_makes_the_others_raise():
    outcomes = launch_ranks(3, killed_peer, grace_s=30)
    assert "signal 9" in outcomes[1].message
    assert outcomes[0].passed and outcomes[2].passed, [o.message for o in outcomes]


def ddp_training(rank, world, backend):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    group = dist.new_group(backend=backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.001)
    ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(5):
        inputs, targets = torch.randn(16, 20, generator=generator), torch.randint(0, 4, (16,), generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(inputs), targets).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_torch_ddp_trains_the_same_on_shm_as_on_gloo():
    on_shm = run_on_ranks(3, ddp_training, "shm")
    on_gloo = run_on_ranks(3, ddp_training, "gloo")
    for rank in range(3):
        for ours, reference in zip(on_shm[rank], on_gloo[rank]):
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    for ours, first in zip(on_shm[2], on_shm[0]):
        assert torch.equal(ours, first), "replicas diverged"


@pytest.fixture(autouse=True)
def nothing_left_in_dev_shm():
    before = {name for name in os.listdir("/dev/shm") if name.startswith("torchpar-")}
    yield
    after = {name for name in os.listdir("/dev/shm") if name.startswith("torchpar-")}
    assert after <= before, f"left in /dev/shm: {sorted(after - before)}"


def simulated_hosts(rank, world, layout):
    """Ranks grouped into hosts by TORCHPAR_HOST_ID: hierarchical ops must equal Gloo's results."""
    os.environ["TORCHPAR_HOST_ID"] = layout[rank]
    shm = dist.new_group(backend="shm")
    gloo = dist.group.WORLD
    for numel in [0, 1, 10007, 3 * 1024 * 1024 + 5]:
        for op in [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT]:
            def allreduce(group):
                tensor = contribution(rank, numel, torch.float64)
                dist.all_reduce(tensor, op=op, group=group)
                return tensor
            assert_same(*both(allreduce, shm, gloo), f"hierarchical allreduce {op} x{numel}")
        averaged = contribution(rank, numel, torch.float64)
        dist.all_reduce(averaged, op=dist.ReduceOp.AVG, group=shm)
        torch.testing.assert_close(averaged, sum(contribution(r, numel, torch.float64) for r in range(world)) / world)
        for root in range(world):
            def broadcast(group):
                tensor = contribution(rank, numel, torch.int32)
                dist.broadcast(tensor, src=root, group=group)
                return tensor
            assert_same(*both(broadcast, shm, gloo), f"hierarchical broadcast from {root} x{numel}")

            def reduce(group):
                tensor = contribution(rank, numel, torch.float32)
                dist.reduce(tensor, dst=root, group=group)
                return tensor
            ours, reference = both(reduce, shm, gloo)
            if rank == root:
                assert_same(ours, reference, f"hierarchical reduce to {root} x{numel}")
            else:  # only the root's tensor changes
                assert torch.equal(ours, contribution(rank, numel, torch.float32))

        def all_gather(group):
            outputs = [torch.empty(numel, dtype=torch.bfloat16) for _ in range(world)]
            dist.all_gather(outputs, contribution(rank, numel, torch.bfloat16), group=group)
            return torch.cat(outputs)
        assert_same(*both(all_gather, shm, gloo), f"hierarchical all_gather x{numel}")

        def reduce_scatter(group):  # goes to Gloo between hosts
            output = torch.empty(numel, dtype=torch.float32)
            dist.reduce_scatter_tensor(output, contribution(rank, numel * world, torch.float32), group=group)
            return output
        assert_same(*both(reduce_scatter, shm, gloo), f"reduce_scatter across hosts x{numel}")
    dist.barrier(group=shm)
    dist.destroy_process_group(shm)
    return True


@pytest.mark.parametrize("layout", [("a", "a", "b", "b"), ("a", "b", "a", "b"), ("a", "b", "b")],
                         ids=["2x2", "interleaved", "1+2"])
def test_simulated_hosts_give_the_same_results(layout):
    assert run_on_ranks(len(layout), simulated_hosts, layout) == [True] * len(layout)


def pipelined_stages(rank, world):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    shm = dist.new_group(backend="shm")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(world)]
    stage = PipelineStage(layers[rank], stage_index=rank, num_stages=world, device=torch.device("cpu"), group=shm)
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    inputs, targets = torch.randn(16, 8), torch.randn(16, 8)
    if rank == 0:
        schedule.step(inputs)
    elif rank == world - 1:
        schedule.step(target=targets)
    else:
        schedule.step()
    # The same model on one process, the loss averaged over the same micro-batches.
    whole = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(world)])
    for layer, copy in zip(layers, whole):
        copy.load_state_dict(layer.state_dict())
    loss = sum(((whole(x) - y) ** 2).mean() for x, y in zip(inputs.chunk(4), targets.chunk(4))) / 4
    loss.backward()
    torch.testing.assert_close(layers[rank].weight.grad, whole[rank].weight.grad)
    dist.destroy_process_group(shm)
    return True


def test_torch_pipelining_runs_on_shm():
    assert run_on_ranks(3, pipelined_stages) == [True] * 3
