"""The planner's command line, ``python -m torchpar.plan``: which strategy fits this model on these ranks.

    python -m torchpar.plan --model torchpar.plan.examples:deep_mlp --batch 64 --world 4 [--memory-per-rank 8MiB]
                            [--verify 3 [--verify-each-strategy]] [--backend gloo|shm] [--out torchpar-plan]
    torchrun --nproc-per-node=4 -m torchpar.plan --model pkg.module:factory --batch 64

Profiles the model's layers on one rank, times whole passes alone and with every rank at once, measures
the process group's all-reduce and transfers and a memory copy on all of them, predicts every strategy (DDP,
ZeRO stages 1-3, pipeline schedules x micro-batches x replicas, parameter server x servers, BSP and ASP, tensor
parallelism) and prints them
ranked by predicted step time, with the configurations that are out and why, and the best one as C++ and
Python code. --verify K runs the top K for a few steps and prints predicted against measured; each run is
kept as a sample in $TORCHPAR_PLAN_CALIBRATION (default ~/.cache/torchpar/plan_calibration.pt), and the
calibration fitted to all of them applies to later plans on this machine.
Writes <out>/plan.json and <out>/plan.png. Without torchrun it spawns --world ranks itself.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import multiprocessing
import os
import pathlib
import re
import statistics

import torch
import torch.distributed as dist

from torchpar.allocator import keep_freed_memory
from torchpar.plan.calibration import calibration_fields, configuration_fields, configuration_from_fields, network_fields
from torchpar.plan.calibration import describe as describe_calibration
from torchpar.plan.host_overhead import measure_host_overheads, measure_process_overhead

# A verified configuration's median is taken over at least --steps steps, and over more where its steps are quick
# (by its prediction): up to this long a run, at most this many steps, a quarter of them as warmup. A median of 5
# steps of a few milliseconds moved by 30-50% between runs here (ranks sharing cores wake each other late).
_TIMED_MS = 250.0
_MOST_STEPS = 50


def timed_steps(predicted_ms: float, fewest: int) -> tuple[int, int]:
    """(warmup, steps) for a configuration predicted to step in `predicted_ms`."""
    steps = max(fewest, min(_MOST_STEPS, math.ceil(_TIMED_MS / max(predicted_ms, 1e-3))))
    return max(2, steps // 4), steps

logger = logging.getLogger("torchpar.plan")
UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match[2].upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 512MiB, 2GiB or 1000000")
    return int(float(match[1]) * UNITS[match[2].upper()])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m torchpar.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="package.module:factory returning a torchpar.plan.Model")
    parser.add_argument("--batch", type=int, required=True, help="global samples per step")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: torchrun's, else 2)")
    parser.add_argument("--memory-per-rank", type=parse_bytes, default=0, help="e.g. 2GiB (default: no cap)")
    parser.add_argument("--verify", type=int, default=0, metavar="K", help="run the top K for real")
    parser.add_argument("--verify-each-strategy", action="store_true",
                        help="also verify the best configuration of every strategy (ddp, sharded, pipeline, ps, "
                             "tensor, pipeline x tensor) outside the top K")
    parser.add_argument("--explain-memory", action="store_true",
                        help="print what a rank of the top configuration holds, line by line (tensors, and the pages "
                             "that are no tensor's), and with --verify each verified one's against what it measured")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per verified configuration, at least "
                        "(more where its steps are quick: up to 0.25 s of them)")
    parser.add_argument("--backend", choices=["gloo", "shm"], default="gloo")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("torchpar-plan"))
    return parser.parse_args(argv)


def strategy_kind(fields: dict) -> str:
    """ddp, pipeline, ps, tensor, or pipeline x tensor (stages of tensor groups)."""
    return "pipeline x tensor" if fields["strategy"] == "pipeline" and fields["tensor"] > 1 else fields["strategy"]


def prediction_fields(prediction) -> dict:
    # The cut the prediction was made with, so that --verify runs (and the calibration re-predicts) that one.
    fields = configuration_fields(prediction.configuration)
    fields["balance"] = list(prediction.balance) or fields["balance"]
    return dict(configuration=prediction.configuration.describe(), step_ms=prediction.step_ms,
                samples_per_second=prediction.samples_per_second, memory_per_rank=prediction.memory_per_rank,
                tensor_memory_per_rank=prediction.tensor_memory_per_rank,
                memory=[dict(what=line.what, bytes=line.bytes, tensor=line.tensor) for line in prediction.memory.lines],
                bubble_fraction=prediction.bubble_fraction, bytes_per_step=prediction.bytes_per_step,
                compute_ms=prediction.compute_ms, fields=fields)


def _percent_off(predicted: int, measured: int) -> str:
    """The prediction's error against a measurement, signed (+: predicted more); "-" where nothing was measured."""
    return f"{100 * (predicted - measured) / measured:+.0f}%" if measured > 0 else "-"


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranked = report["ranked"][:10]
    verified = report["verified"]
    figure, axes = plt.subplots(1, 2 if verified else 1, figsize=(13 if verified else 7, 4.8), squeeze=False)
    memory = axes[0][0]
    labels = [f"{i + 1}. {p['configuration']}" for i, p in enumerate(ranked)][::-1]
    memory.barh(labels, [p["memory_per_rank"] / 2**20 for p in ranked][::-1], color="tab:purple", label="predicted")
    position = {p["configuration"]: len(ranked) - 1 - i for i, p in enumerate(ranked)}
    shown = [v for v in verified if v.get("measured_memory") and v["configuration"] in position]
    if shown:
        memory.scatter([v["measured_memory"] / 2**20 for v in shown], [position[v["configuration"]] for v in shown],
                       color="black", marker="D", zorder=3, label="measured (--verify)")
    if report["memory_per_rank_cap"]:
        memory.axvline(report["memory_per_rank_cap"] / 2**20, color="red", lw=1, label="cap")
    memory.legend(fontsize=8)
    memory.set(xlabel="memory per rank (MiB)", title="the top configurations")
    memory.tick_params(axis="y", labelsize=7)
    if verified:
        timing = axes[0][1]
        names = [v["configuration"] for v in verified]
        positions = range(len(verified))
        timing.bar([p - 0.2 for p in positions], [v["predicted_ms"] for v in verified], 0.4, label="predicted")
        timing.bar([p + 0.2 for p in positions], [v["measured_ms"] for v in verified], 0.4, label="measured")
        timing.set_xticks(list(positions), names, rotation=15, ha="right", fontsize=7)
        timing.set(ylabel="step time (ms)", title="predicted against measured (--verify)")
        timing.legend(fontsize=8)
    for axis in axes[0]:
        axis.title.set_fontsize(9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# Passes before and after the verification further apart than this: the machine's speed moved meanwhile (a shared
# host's neighbours; here up to 1.6x within one run).
_STEADY_DRIFT = 1.2


def machine_drift(before, after) -> float:
    """How far apart (a ratio, at least 1) the whole model's passes timed before and after the verification are."""
    ratios = [after.alone_ms / before.alone_ms, after.together_ms / before.together_ms]
    return max(max(ratios), 1 / min(ratios))


def verification_profile(model_profile, before, after):
    """The profile at the machine's speed while the configurations were verified: scaled to the whole model's
    passes measured just before and just after (geometric means). A shared machine's speed drifts; samples scaled
    so teach the calibration how configurations differ from the passes, not the drift since planning."""
    alone = math.sqrt(before.alone_ms * after.alone_ms)
    scaled = model_profile.scaled_to(alone)
    scaled.contention = math.sqrt(before.together_ms * after.together_ms) / alone
    return scaled


def run(rank: int, world: int, args: argparse.Namespace) -> None:
    import torchpar.plan as planner
    from torchpar.plan.verify import Measurement, measure

    torch.set_num_threads(1)  # the ranks share the machine's cores
    # Profile, passes and verified steps all without faulting freed memory back in, which a fresh process does
    # and a longer-lived one may not: otherwise a step's time depends on what the process allocated before.
    keep_freed_memory()  # also counts: the allocator's view of each verified configuration's peak

    control = dist.new_group(backend="gloo")
    group = dist.new_group(backend=args.backend) if args.backend != "gloo" else dist.group.WORLD
    model = planner.load_model(args.model)
    torch.manual_seed(0)
    report = None
    per_rank = max(1, args.batch // world)
    if rank == 0:
        logger.info("profiling %s (%d layers) at %d samples per rank", args.model, len(model.layers), per_rank)
        model_profile, optimizer_ms_per_byte = planner.profile(model, per_rank)
        model_profile.heap_retention_bytes = planner.measure_heap_retention(model, per_rank)
    dist.barrier(group=control)
    passes = planner.measure_model_pass(model, per_rank, control)
    network = planner.measure_network(group)
    network.host_memory.keeps_freed_memory = True
    network.host_memory.process_overhead_bytes = measure_process_overhead(network, control, args.backend)
    # The default calibration, with the engines' host times measured on these ranks: what this plan predicts
    # with unless earlier --verify runs taught one, and where this run's --verify fit starts.
    calibration, store_error = None, None
    if rank == 0:
        try:
            calibration = planner.load_calibration(world, args.backend)
        except RuntimeError as error:  # a file that is no calibration store: every rank stops, rank 0 says why
            store_error = str(error)
    verifying = args.verify > 0 or args.verify_each_strategy
    needs_default = [calibration is None or verifying, store_error]
    dist.broadcast_object_list(needs_default, src=0, group=control)
    if needs_default[1]:
        raise RuntimeError(needs_default[1] if rank == 0 else "rank 0 could not read the calibration store")
    default = planner.default_calibration(world)
    probes = []  # the runs behind the default, as calibration samples
    if needs_default[0]:
        probes = measure_host_overheads(default, network, control, args.backend)
        if rank == 0:
            logger.info("the engines' host time, measured on these ranks: collectives while computing x %.2f, "
                        "%.2f ms per pipeline action; parameter server %.2f ms per step, %.2f ms/MiB and %.2f ms "
                        "per step of sparse rows", default.communication_scale, default.per_action_ms,
                        default.ps_per_step_ms, default.ps_ms_per_byte * 2**20, default.ps_rows_ms)
    if rank == 0:
        logger.info("the whole model's forward and backward: %.2f ms alone, %.2f ms with %d ranks at once; the "
                    "layers one at a time: %.2f ms (scaled to the whole model's alone)", passes.alone_ms,
                    passes.together_ms, world, model_profile.compute_ms)
        model_profile = model_profile.scaled_to(passes.alone_ms)
        model_profile.contention = passes.together_ms / passes.alone_ms
        learned = calibration is not None
        calibration = calibration or default
        result = planner.plan(model, model_profile, network, batch=args.batch, world=world,
                              memory_per_rank=args.memory_per_rank, optimizer_ms_per_byte=optimizer_ms_per_byte,
                              calibration=calibration)
        described = lambda link: f"{link.alpha_ms:.3f} ms + {link.ms_per_byte * 2**20:.3f} ms/MiB"
        logger.info("all-reduce %s, all-gather %s, reduce-scatter %s, transfer %s (%s, %d ranks), between "
                    "stages %s, DDP's buckets %s, copy %.3f ms/MiB; %s",
                    *map(described, (network.all_reduce, network.all_gather, network.reduce_scatter,
                                     network.send_recv)),
                    args.backend, world,
                    "through the group" if network.stage_transfer is None else
                    "through same-host rings " + described(network.stage_transfer),
                    "through the group" if network.ddp_all_reduce is None else
                    "through a same-host shm group " + described(network.ddp_all_reduce),
                    network.copy.ms_per_byte * 2**20,
                    ("calibration from earlier --verify runs: " if learned else "default calibration: ") +
                    describe_calibration(calibration))
        print(planner.render_table(result), flush=True)
        if args.explain_memory and result.ranked:
            print(f"memory per rank of {result.ranked[0].configuration.describe()} (its fullest rank; measured: the "
                  f"model's training in one process kept {model_profile.heap_retention_bytes / 2**20:.1f} MiB of "
                  f"the heap's small blocks, a rank's overhead {network.host_memory.process_overhead_bytes / 2**20:.1f} MiB):\n"
                  + result.ranked[0].memory.render(), flush=True)
        if result.ranked:
            print("recommended, C++:\n" + result.recommended_cpp + "\nrecommended, Python:\n" +
                  result.recommended_python, flush=True)
        report = dict(model=args.model, batch=args.batch, world=world, backend=args.backend,
                      memory_per_rank_cap=args.memory_per_rank,
                      calibration=calibration_fields(calibration),
                      calibration_learned=learned,
                      network=network_fields(network),
                      probe_samples=len(probes),
                      ranked=[prediction_fields(p) for p in result.ranked],
                      excluded=[dict(configuration=e.configuration.describe(), reason=e.reason)
                                for e in result.excluded],
                      verified=[])
    chosen = [None, None]  # the configurations to verify, and each layer's tensor-parallel role
    if rank == 0:
        from torchpar._C import plan as engine

        chosen[0] = report["ranked"][:args.verify]
        if args.verify_each_strategy:
            for kind in ("ddp", "sharded", "pipeline", "ps", "tensor", "pipeline x tensor"):
                best = next((p for p in report["ranked"] if strategy_kind(p["fields"]) == kind), None)
                if best is not None and best not in chosen[0]:
                    chosen[0].append(best)
        # Each layer's part where a tensor group splits it (within each stage for a pipeline of tensor groups).
        chosen[1] = [engine.tensor_parallel_roles(model_profile, entry["fields"]["balance"]
                                                  if entry["fields"]["strategy"] == "pipeline" else [])
                     for entry in chosen[0]]
    dist.broadcast_object_list(chosen, src=0, group=control)
    measured = []
    if chosen[0]:
        from tqdm import tqdm

        # One untimed step of the first configuration of each strategy: what a process sets up once for it
        # (threads, the libraries' code it pages in, the first groups' buffers: ~160 MiB for a pipeline after a
        # parameter server) is then not counted in that strategy's memory.
        first_of_kind = {}
        for entry, roles in zip(*chosen):
            first_of_kind.setdefault(strategy_kind(entry["fields"]), (entry, roles))
        for entry, roles in first_of_kind.values():
            measure(model, configuration_from_fields(entry["fields"]), args.batch, args.backend, control, warmup=0,
                    steps=1, tensor_roles=roles)
        # Two rounds, the second in reverse order, so that a slow spell of the machine (they last seconds here)
        # weighs on every configuration rather than on the ones it happened to hit. The whole model's passes
        # before and after: the machine's speed meanwhile, which the calibration's samples are scaled to.
        levels = [planner.measure_model_pass(model, per_rank, control)]
        rounds = [[] for _ in chosen[0]]
        order = list(range(len(chosen[0])))
        with tqdm(total=2 * len(order), desc="verify", unit="config", disable=rank != 0) as progress:
            for index in order + order[::-1]:
                warmup, steps = timed_steps(chosen[0][index]["step_ms"], args.steps)
                rounds[index].append(measure(model, configuration_from_fields(chosen[0][index]["fields"]), args.batch,
                                             args.backend, control, warmup=warmup, steps=steps,
                                             tensor_roles=chosen[1][index]))
                progress.update()
        levels.append(planner.measure_model_pass(model, per_rank, control))
        measured = [Measurement(statistics.mean(m.step_ms for m in both), max(m.memory_bytes for m in both),
                                max(m.allocated_bytes for m in both))
                    for both in rounds]
    if rank == 0:
        if measured:
            for entry, measurement in zip(chosen[0], measured):
                report["verified"].append(dict(configuration=entry["configuration"], predicted_ms=entry["step_ms"],
                                               measured_ms=measurement.step_ms,
                                               predicted_memory=entry["memory_per_rank"],
                                               predicted_tensor_memory=entry["tensor_memory_per_rank"],
                                               measured_memory=measurement.memory_bytes,
                                               measured_allocated=measurement.allocated_bytes))
            configurations = [configuration_from_fields(e["fields"]) for e in chosen[0]]
            logger.info("the whole model's forward and backward around the verified runs: %.2f and %.2f ms alone, "
                        "%.2f and %.2f ms together", levels[0].alone_ms, levels[1].alone_ms, levels[0].together_ms,
                        levels[1].together_ms)
            drift = machine_drift(*levels)
            report["machine_drift"] = drift
            if drift > _STEADY_DRIFT:
                logger.warning("the machine's speed moved by %.0f%% during the verification (the whole model's "
                               "passes before and after it): the measured steps carry that drift, and so do their "
                               "errors against the predictions", 100 * (drift - 1))
            verified_profile = verification_profile(model_profile, *levels)
            samples = [planner.calibration_sample(model, verified_profile, network, configuration, batch=args.batch,
                                                  optimizer_ms_per_byte=optimizer_ms_per_byte,
                                                  measured_ms=measurement.step_ms)
                       for configuration, measurement in zip(configurations, measured)]
            learned, sample_count = planner.learn_calibration(probes + samples, world, args.backend, start=default)
            for row, configuration in zip(report["verified"], configurations):
                row["calibrated_ms"] = planner.predict_step_ms(model, model_profile, network, configuration,
                                                               batch=args.batch,
                                                               optimizer_ms_per_byte=optimizer_ms_per_byte,
                                                               calibration=learned)
            report["learned_calibration"] = calibration_fields(learned)
            report["calibration_samples"] = sample_count
            print(f"verified (step ms): configuration | predicted | measured | error | calibrated | error | resident "
                  f"set per rank predicted | measured (growth) | error | tensors per rank predicted | measured "
                  f"(the allocator's peak) | error\n"
                  f"  (predicted: with the calibration above; calibrated: fitted to {sample_count} runs on this "
                  f"machine, verified ones and host-time probes, these included: {describe_calibration(learned)})",
                  flush=True)
            for row in report["verified"]:
                error = abs(row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]
                calibrated = abs(row["calibrated_ms"] - row["measured_ms"]) / row["measured_ms"]
                print(f"  {row['configuration']} | {row['predicted_ms']:.2f} | {row['measured_ms']:.2f} | "
                      f"{100 * error:.0f}% | {row['calibrated_ms']:.2f} | {100 * calibrated:.0f}% | "
                      f"{row['predicted_memory'] / 2**20:.1f} MiB | {row['measured_memory'] / 2**20:.1f} MiB | "
                      f"{_percent_off(row['predicted_memory'], row['measured_memory'])} | "
                      f"{row['predicted_tensor_memory'] / 2**20:.1f} MiB | {row['measured_allocated'] / 2**20:.1f} MiB | "
                      f"{_percent_off(row['predicted_tensor_memory'], row['measured_allocated'])}",
                      flush=True)
            fastest = min(m.step_ms for m in measured)
            print(f"the top-ranked configuration measured {measured[0].step_ms / fastest:.2f}x the fastest verified "
                  "one", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan.json").write_text(json.dumps(report, indent=1))
        plot(report, args.out / "plan.png")
        logger.info("wrote %s and %s", args.out / "plan.json", args.out / "plan.png")


def spawned_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torchpar

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    timeout = datetime.timedelta(minutes=5)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    torchpar.init_process_group(backend="gloo", rank=rank, world_size=world, store=store, timeout=timeout)
    run(rank, world, args)
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torchpar

    if "RANK" in os.environ:  # under torchrun
        torchpar.init_process_group(backend="gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
        if args.world not in (None, world):
            logger.error("--world %d, but torchrun started %d ranks", args.world, world)
            return 2
        run(rank, world, args)
        dist.destroy_process_group()
        return 0
    world = args.world or 2
    from torchpar.plan.model import load_model

    load_model(args.model)  # a wrong --model fails here, before any rank starts
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=spawned_rank, args=(rank, world, store.port, args)) for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    failed = [rank for rank, process in enumerate(ranks) if process.exitcode != 0]
    if failed:
        logger.error("rank(s) %s failed", failed)
        return 1
    return 0

