"""Trains an MLP too big for DDP under a memory cap on the 8x8 digits with torchpar's sharded data parallelism
(ZeRO stage 1, 2 or 3) and Adam, then tests it.

    python3 scripts/export_digits.py                  # once (scripts/setup.sh does it): data/digits.pt
    torchrun --nproc-per-node=4 examples/python/train_sharded.py --stage 3 --memory-per-rank 48MiB
    torchrun --nproc-per-node=4 examples/python/train_sharded.py --stage 2 --memory-per-rank 64MiB
    torchrun --nproc-per-node=4 examples/python/train_sharded.py --stage 2 --memory-per-rank 48MiB   # refused
    torchrun --nproc-per-node=2 examples/python/train_sharded.py --hidden 256 --layers 3 --memory-per-rank 4MiB

The MLP (64-H-...-H-10 with --layers hidden layers of H = --hidden; 5,324,810 parameters Ψ at the default 6 of 1024)
trains in fp32 with Adam. --memory-per-rank caps what the CPU allocator holds for a rank at its fullest moment
(torchpar.allocator's count: the process's own libraries and buffers aside), and before anything is sharded two
figures are predicted for each strategy on N ranks:

- the model state between steps (parameters, gradients, Adam's two moments), by ZeRO's formulas and this engine's
  layout: DDP 16Ψ bytes; stage 1 8Ψ + 16S; stage 2 4Ψ + 16S; stage 3 16S, where S (Ψ/N plus each bucket's padding
  to a multiple of N; at stage 3 a bucket is a unit, here each Linear layer) is the rank's shard, which the engine
  keeps as a flat fp32 copy the optimizer steps (4S) beside its Adam state (8S) and averaged gradient (4S);
- the peak during a step, by torchpar's planner (torchpar.plan.predict_memory, from a profile of the layers): the
  state plus what a step adds, e.g. at stage 3 the buckets being reduce-scattered (the unit's gradients, their flat
  copy, two earlier units' still in flight), the activations, Adam's temporaries on the shard, and building the
  model whole before it is sharded.

Rank 0 logs which strategies' peaks fit the cap and the chosen one's lines. When the chosen stage's does not fit,
every rank exits with status 2 and the message on stderr; otherwise it trains, measures the allocator's peak (the
largest rank's) and the model state it holds after its last step (a tensor shared counts once) and prints them next
to the predictions, with one result line:

    train_sharded: 4 ranks, stage 3, peak allocated 39.8 MiB per rank (predicted 40.2, DDP's 102.4, cap 48.0),
    model state 20.3 MiB (predicted 20.3), 6 epochs in 8.49 s, test accuracy 97.2%

A smaller --bucket-cap-mb lowers stages 1-2's peak (fewer gradients in flat copies at once). Exit code: 0; 1 when
the accuracy is below 95% or the peak measured exceeds the cap; 2 for a wrong launch, missing data or a stage whose
predicted peak does not fit.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import math
import pathlib
import re
import sys
import time

import torch
import torch._dynamo  # noqa: F401  (before the process group exists: torch.optim imports it on its first step)
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchpar
import torchpar.plan
from torchpar.plan.examples import digits_wide_mlp
from torchpar.plan.verify import resident_kib, start_memory_watch
from torchpar.same_host import shm_group_beside

logger = logging.getLogger("torchpar.examples.train_sharded")
DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "digits.pt"
TARGET_ACCURACY = 0.95
MiB = 1 << 20
UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match[2].upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 48MiB, 1GiB or 50000000")
    return int(float(match[1]) * UNITS[match[2].upper()])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, default=DATA, help="written by scripts/export_digits.py")
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=3,
                        help="ZeRO stage: 1 shards Adam's state, 2 also the gradients, 3 also the parameters")
    parser.add_argument("--memory-per-rank", type=parse_bytes, default=48 * MiB,
                        help="the cap on a rank's tensors at its peak, e.g. 48MiB (default)")
    parser.add_argument("--hidden", type=int, default=1024, help="width of the MLP's hidden layers")
    parser.add_argument("--layers", type=int, default=6, help="the MLP's hidden layers")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0,
                        help="gradient MiB per reduce-scatter (and per all-gather of the updated parameters)")
    parser.add_argument("--backend", choices=["gloo", "shm"], default=None,
                        help="process-group backend (default: $TORCHPAR_BACKEND, else gloo)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-keep-freed-memory", action="store_true",
                        help="leave freed memory to glibc, as a fresh process does (torchpar.keep_freed_memory: "
                             "docs/launching.md); the resident set is then measured, not predicted")
    args = parser.parse_args()
    if args.hidden < 1 or args.layers < 1:
        parser.error("--hidden and --layers must be at least 1")
    return args


def shard_elements(numels: list[int], world: int, bucket_cap_bytes: int, element_size: int = 4) -> int:
    """S: the elements of one rank's shard. The engine's buckets (torchpar/sharded/shard_layout.h): parameters in
    reverse registration order, a bucket closing once it holds at least its cap (the first's 1 MiB, as DDP's, then
    the --bucket-cap-mb); each padded to a multiple of the group and cut into equal pieces, one per rank."""
    caps = [min(1 << 20, bucket_cap_bytes), bucket_cap_bytes]
    buckets, open_elements = [], 0
    for numel in reversed(numels):
        open_elements += numel
        if open_elements * element_size >= caps[min(len(buckets), 1)]:
            buckets.append(open_elements)
            open_elements = 0
    if open_elements:
        buckets.append(open_elements)
    return sum(math.ceil(b / world) for b in buckets)


def unit_shard_elements(unit_numels: list[int], world: int) -> int:
    """S at stage 3: each unit (here a Linear layer) is one bucket, padded to a multiple of the group."""
    return sum(math.ceil(numel / world) for numel in unit_numels)


def state_predictions(parameters: int, shard: int, unit_shard: int) -> dict[str, tuple[int, str]]:
    """Each strategy's model state per rank between steps in bytes (fp32, Adam), and how it adds up."""
    return {
        "DDP": (16 * parameters, "4Ψ params + 4Ψ grads + 8Ψ Adam"),
        "stage 1": (8 * parameters + 16 * shard, f"4Ψ + 4Ψ + 8Ψ/N (ZeRO) + 8S (the shard's copy and averaged "
                                                 f"gradient), S = {shard:,}"),
        "stage 2": (4 * parameters + 16 * shard, f"4Ψ + 12Ψ/N (ZeRO) + 4S (the shard's copy), S = {shard:,}"),
        "stage 3": (16 * unit_shard, f"16Ψ/N (ZeRO), padded: 16S, S = {unit_shard:,}"),
    }


def peak_predictions(model: torchpar.plan.Model, batch: int, world: int, bucket_cap_bytes: int) -> dict:
    """Each strategy's peak per rank by the planner: a MemoryBreakdown (``tensor_bytes``; ``total``, the resident
    set; ``render()``). The model's layers are profiled in this process (their activations, and backward's
    temporaries as the allocator counts them), and where freed memory is kept, what the heap keeps beyond the
    tensors while it trains in this process."""
    profile, _ = torchpar.plan.profile(model, batch=batch, repeats=1)
    network = torchpar.plan.NetworkProfile()
    network.host_memory.keeps_freed_memory = torchpar.allocator.keeping_freed_memory()
    if network.host_memory.keeps_freed_memory:
        profile.heap_retention_bytes = torchpar.plan.measure_heap_retention(model, batch)
    if shm_group_beside(dist.group.WORLD, torch.device("cpu")) is not None:  # the engine's collectives' segment
        network.host_memory.shm_chunk_bytes = torchpar._C.plan.SHM_CHUNK_BYTES
    peaks = {}
    for name, stage in (("DDP", 0), ("stage 1", 1), ("stage 2", 2), ("stage 3", 3)):
        configuration = torchpar.plan.Configuration()
        configuration.world = world
        if stage:  # DDP keeps torch's bucket caps
            configuration.strategy, configuration.zero_stage = torchpar.plan.Strategy.sharded, stage
            configuration.bucket_bytes = bucket_cap_bytes
        peaks[name] = torchpar.plan.predict_memory(model, profile, configuration, batch=batch * world,
                                                   network=network)
    return peaks


def held_bytes(module: nn.Module, model: torchpar.ShardedDataParallel, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes of the model-state tensors alive on this rank, by kind; a storage two tensors share counts once."""
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    parameters = list(module.parameters())
    shards = model.shard_parameters()
    return {
        "parameters": size(parameters),
        "shard": size(shards),
        "gradients": size([p.grad for p in parameters] + [s.grad for s in shards]),
        "optimizer state": size([v for state in optimizer.state.values() for v in state.values()
                                 if isinstance(v, torch.Tensor)]),
    }


@torch.no_grad()
def test_accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> tuple[int, int]:
    """(correct, total) over the whole test set: each rank scores every world-th sample, counts are summed. `net`
    is the wrapped model: at stage 3 its forward gathers each layer."""
    net.eval()
    mine_x, mine_y = x[rank::world], y[rank::world]
    counts = torch.tensor([(net(mine_x).argmax(dim=1) == mine_y).sum().item(), len(mine_y)], dtype=torch.int64)
    dist.all_reduce(counts)
    return int(counts[0]), int(counts[1])


def refuse(rank: int, message: str) -> int:
    if rank == 0:
        print(f"train_sharded.py: {message}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return 2


def main() -> int:
    args = parse_args()
    try:
        torchpar.init_process_group(backend=args.backend)
    except torchpar.LaunchError as error:
        print(f"train_sharded.py: {error}", file=sys.stderr)
        return 2
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    if not args.data.is_file():
        return refuse(rank, f"{args.data} not found; write it with `python3 scripts/export_digits.py`")
    data = torch.load(args.data)
    train = TensorDataset(data["train_x"], data["train_y"])
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()
    # The allocator's view of the peak: what is allocated from here on, beside the data.
    if args.no_keep_freed_memory:
        torchpar.allocator.count_cpu_allocations()
    else:
        torchpar.keep_freed_memory()  # also counts
    before = torchpar.allocator.cpu_memory_allocated()

    torch.manual_seed(args.seed)
    # The MLP as the planner knows it, its units the layers: each hidden Linear with its ReLU, then the output Linear.
    planned = digits_wide_mlp(args.hidden, args.layers)
    net = nn.Sequential(*[module for layer in planned.layers
                          for module in (layer if isinstance(layer, nn.Sequential) else [layer])])
    numels = [p.numel() for p in net.parameters()]
    parameters = sum(numels)
    bucket_cap_bytes = int(args.bucket_cap_mb * MiB)
    shard = shard_elements(numels, world, bucket_cap_bytes)
    units = [sum(p.numel() for p in module.parameters()) for module in net if isinstance(module, nn.Linear)]
    states = state_predictions(parameters, shard, unit_shard_elements(units, world))
    # Profiled on a copy, freed after: the planner's passes leave the model's values alone.
    peaks = peak_predictions(dataclasses.replace(planned, layers=copy.deepcopy(planned.layers)), args.batch_size,
                             world, bucket_cap_bytes)
    cap = args.memory_per_rank
    logger.info("MLP 64-%dx%d-10: Ψ = %s fp32 parameters, Adam, %d ranks, %d samples per rank; per rank, predicted, "
                "against the cap of %.1f MiB on the peak:", args.hidden, args.layers, f"{parameters:,}", world,
                args.batch_size, cap / MiB)
    logger.info("  %-8s %10s %10s", "", "peak", "state")
    for name, (state, formula) in states.items():
        peak = peaks[name].tensor_bytes
        logger.info("  %-8s %6.1f MiB %6.1f MiB  %-7s  state: %s", name, peak / MiB, state / MiB,
                    "fits" if peak <= cap else "exceeds", formula)
    chosen = f"stage {args.stage}"
    needed = peaks[chosen].tensor_bytes
    if needed > cap:
        fitting = [name for name, peak in peaks.items() if peak.tensor_bytes <= cap]
        alternatives = f"{' and '.join(fitting)} would fit" if fitting else "no strategy fits"
        return refuse(rank, f"{chosen} needs {needed / MiB:.1f} MiB per rank at its peak on {world} ranks, over "
                            f"--memory-per-rank {cap / MiB:.1f} MiB; {alternatives} (more ranks shrink the sharded "
                            "parts)")
    logger.info("%s at its peak, by the planner:\n%s", chosen, peaks[chosen].render().rstrip())

    # The profile's allocations are gone; the peak from here on is the model's, built whole, wrapped, trained.
    torchpar.allocator.reset_cpu_peak_memory()
    # The resident set from here on, the libraries' pages aside (code run for the first time, not memory held).
    resident_before = (start_memory_watch() or 0) - (resident_kib("RssFile") or 0)
    held_before = torchpar.allocator.cpu_memory_allocated() - before  # the model built whole, already resident
    # Rank 0's weights are copied to every rank; at stage 3 each Linear layer (the Sequential's children that hold
    # parameters) is a unit, gathered for its forward and backward only.
    model = torchpar.ShardedDataParallel(net, stage=args.stage, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torchpar.ShardedOptimizer(model, torch.optim.Adam, lr=args.lr)  # steps this rank's shard only
    logger.info("training on %d digits: %s, backend %s, %d epochs, batch %d per rank, buckets of %.1f MiB",
                len(train), chosen, dist.get_backend(), args.epochs, args.batch_size, args.bucket_cap_mb)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
        model.train()
        loss_sum = 0.0
        for x, y in loader:
            optimizer.zero_grad()  # also releases the parameters' own gradients (stage 1 keeps them until here)
            loss = loss_fn(model(x), y)
            loss.backward()  # buckets reduce-scattered while backward runs
            optimizer.step()  # this rank's shard stepped, then every shard all-gathered into the parameters
            loss_sum += loss.item()
        logger.info("epoch %d/%d  loss %.4f", epoch + 1, args.epochs, loss_sum / len(loader))
    seconds = time.perf_counter() - start
    peak = torchpar.allocator.cpu_max_memory_allocated() - before
    resident = ((resident_kib("VmHWM") or 0) - (resident_kib("RssFile") or 0) - resident_before) * 1024
    resident_predicted = peaks[chosen].total - held_before

    # What the rank holds after its last step, before the next zero_grad: the most it holds between steps.
    held = held_bytes(net, model, optimizer)
    state = sum(held.values())
    state_predicted = states[chosen][0]
    logger.info("held after the last step: %s = %.1f MiB (predicted %.1f MiB; measured - predicted = %d bytes)",
                ", ".join(f"{kind} {nbytes / MiB:.2f} MiB" for kind, nbytes in held.items()), state / MiB,
                state_predicted / MiB, state - state_predicted)
    correct, total = test_accuracy(model, data["test_x"], data["test_y"], rank, world)
    accuracy = correct / total
    largest = torch.tensor([peak, state, resident], dtype=torch.int64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # the rank holding the most
    peak, state, resident = map(int, largest)
    resident_line = (f"resident set +{resident / MiB:.1f} MiB (glibc's, not predicted)" if args.no_keep_freed_memory
                     else f"resident set +{resident / MiB:.1f} MiB (predicted {resident_predicted / MiB:.1f})")
    if rank == 0:
        print(f"train_sharded: {world} ranks, {chosen}, peak allocated {peak / MiB:.1f} MiB per rank (predicted "
              f"{needed / MiB:.1f}, DDP's {peaks['DDP'].tensor_bytes / MiB:.1f}, cap {cap / MiB:.1f}), model state "
              f"{state / MiB:.1f} MiB (predicted {state_predicted / MiB:.1f}), {resident_line}, {args.epochs} epochs in {seconds:.2f} s, "
              f"test accuracy {100 * accuracy:.1f}%", flush=True)
        if accuracy < TARGET_ACCURACY:
            logger.error("below the %.0f%% this example should reach", 100 * TARGET_ACCURACY)
        if peak > cap:
            logger.error("the peak measured exceeds the cap of %.1f MiB", cap / MiB)
    del optimizer, model
    dist.destroy_process_group()
    return 0 if accuracy >= TARGET_ACCURACY and peak <= cap else 1


if __name__ == "__main__":
    sys.exit(main())
