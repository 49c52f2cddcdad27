"""Where a pipeline's bubble beyond the simulator's prediction comes from: the engine, or its costs' spread.

    python benchmarks/pipeline_replay.py [--schedules 1f1b zero_bubble] [--microbatches 8] [--steps 30]

benchmarks/pipeline.py predicts the bubble from each stage's *mean* action durations. This script runs
torchpar's pipeline on 2 ranks (the same model and cut as that benchmark), records every step's timeline
(pipe.last_step_timeline), and replays each step with the dependencies every schedule obeys (a forward needs
the previous stage's forward of its micro-batch, a backward or input-gradient the next stage's, each one transfer
later; a rank runs its actions in the order it ran them), three ways:

    measured       1 - compute of both ranks / (2 x the slower rank's step), as the run went
    own durations  the replay with each action's own duration: the step an engine with no overhead beyond the
                   dependencies would have taken with the costs this step had
    mean durations the replay with each stage's mean duration per action type (what the prediction assumes)

measured - own durations is what the engine added (host work, late transfers, skew between the ranks' starts);
own - mean durations is what the spread of the action durations on the critical path costs, which no
engine removes. The transfer is measured as benchmarks/pipeline.py measures it (half a round trip).
"""
import argparse
import logging
import statistics

import torch.distributed as dist

from bench_ranks import join_world, run_world, say_whether_pinned
from pipeline import IMPLS, Config, WARMUP_STEPS, measure_transfer

logger = logging.getLogger("torchpar.bench")
WORLD = 2


def replay(timelines: list[list[tuple]], transfer_ms: float) -> float:
    """The makespan of each rank's actions (kind, stage, micro-batch, ms) in their order, each starting once its rank
    is free and its input from a neighbouring stage arrived."""
    last_stage = max(stage for timeline in timelines for _, stage, _, _ in timeline)
    finished: dict[tuple, float] = {}  # ("F" or "B", stage, micro-batch) -> when its output left
    free = [0.0] * len(timelines)
    position = [0] * len(timelines)
    remaining = sum(map(len, timelines))
    while remaining:
        progressed = False
        for rank, timeline in enumerate(timelines):
            if position[rank] == len(timeline):
                continue
            kind, stage, microbatch, ms = timeline[position[rank]]
            direction = "F" if kind == "F" else "B"  # an input-gradient (I) sends upstream as a backward does
            needs = None
            if kind == "F" and stage > 0:
                needs = ("F", stage - 1, microbatch)
            elif kind in ("B", "I") and stage < last_stage:
                needs = ("B", stage + 1, microbatch)
            if needs is not None and needs not in finished:
                continue
            start = max(free[rank], finished[needs] + transfer_ms if needs else 0.0)
            free[rank] = start + ms
            if kind != "W":
                finished[(direction, stage, microbatch)] = free[rank]
            position[rank] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("the recorded orders wait on each other: not a schedule's timeline")
    return max(free)


def rank_main(rank: int, world: int, port: int, options: dict, results) -> None:
    control, _ = join_world(rank, world, port)
    groups = {impl: dist.new_group(backend="gloo") for impl in IMPLS}  # Config builds both engines
    rows = []
    for schedule in options["schedules"]:
        for m in options["microbatches"]:
            config = Config(schedule, m, groups)
            transfer_ms = measure_transfer(config, rank, control)
            for _ in range(WARMUP_STEPS):
                config.step("torchpar")
            steps = []
            for _ in range(options["steps"]):
                dist.barrier(group=control)
                config.step("torchpar")
                timeline = [(str(t.action.type).rsplit(".", 1)[-1], t.action.stage, t.action.microbatch,
                             t.end - t.start) for t in config.pipe.last_step_timeline]
                steps.append((timeline, config.pipe.last_step_milliseconds))
            gathered: list = [None] * world
            dist.all_gather_object(gathered, steps, group=control)
            rows.append(dict(schedule=schedule, microbatches=m, transfer_ms=transfer_ms, steps=gathered))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def figures(row: dict) -> dict:
    steps = list(zip(*row["steps"]))  # per step: each rank's (timeline, step ms)
    durations: dict[tuple, list[float]] = {}
    for step in steps:
        for timeline, _ in step:
            for kind, stage, _, ms in timeline:
                durations.setdefault((kind, stage), []).append(ms)
    mean = {key: statistics.mean(values) for key, values in durations.items()}
    measured, own, means = [], [], []
    for step in steps:
        timelines = [timeline for timeline, _ in step]
        compute = sum(ms for timeline in timelines for *_, ms in timeline)
        measured.append(1 - compute / (WORLD * max(step_ms for _, step_ms in step)))
        own.append(1 - compute / (WORLD * replay(timelines, row["transfer_ms"])))
        averaged = [[(kind, stage, microbatch, mean[(kind, stage)]) for kind, stage, microbatch, _ in timeline]
                    for timeline in timelines]
        mean_compute = sum(ms for timeline in averaged for *_, ms in timeline)
        means.append(1 - mean_compute / (WORLD * replay(averaged, row["transfer_ms"])))
    spread = max(statistics.pstdev(values) / statistics.mean(values) for values in durations.values())
    return dict(measured=statistics.median(measured), own=statistics.median(own), mean=statistics.median(means),
                spread=spread)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zero_bubble"],
                        choices=["gpipe", "1f1b", "zero_bubble"])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8])
    parser.add_argument("--steps", type=int, default=30, help="recorded steps per configuration")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    say_whether_pinned()
    rows = run_world(WORLD, rank_main, dict(schedules=args.schedules, microbatches=args.microbatches, steps=args.steps))
    lines = ["| schedule | m | transfer ms | measured bubble | replayed, own durations | replayed, mean durations "
             "| engine's share (measured - own) | spread's share (own - mean) "
             "| largest spread of a stage's durations |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        f = figures(row)
        lines.append(f"| {row['schedule']} | {row['microbatches']} | {row['transfer_ms']:.2f} | {f['measured']:.1%} "
                     f"| {f['own']:.1%} | {f['mean']:.1%} | {100 * (f['measured'] - f['own']):+.1f} pp "
                     f"| {100 * (f['own'] - f['mean']):+.1f} pp | {f['spread']:.0%} (std/mean) |")
    logger.info("2 ranks, medians over %d steps\n\n%s", args.steps, "\n".join(lines))


if __name__ == "__main__":
    main()
