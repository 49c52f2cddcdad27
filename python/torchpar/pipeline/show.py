"""Print and plot what the C++ simulator predicts for one pipeline schedule.

    python -m torchpar.pipeline.show 1f1b --stages 4 --microbatches 8
    python -m torchpar.pipeline.show interleaved --stages 4 --microbatches 8 --virtual-stages 2
    python -m torchpar.pipeline.show zero_bubble --stages 4 --microbatches 8 --png zb.png

Prints the timeline grid, the makespan, the bubble fraction beside its closed form (where the
schedule has one for these costs) and the peak number of activations alive per rank, then writes
the timeline as a PNG.
"""
from __future__ import annotations

import argparse
import pathlib
from typing import NamedTuple, Optional, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

# The engine itself rather than the package's re-exports: the CLI needs nothing of the runtime.
from torchpar._C import pipeline as engine

ACTION_COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
ACTION_MEANINGS = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}


class ClosedForm(NamedTuple):
    formula: str
    bubble: float


def closed_form(arguments: argparse.Namespace) -> Optional[ClosedForm]:
    """The bubble fraction in closed form, or None where none holds for these arguments.

    Each form is checked against the simulator in tests/python/test_pipeline_schedules.py. GPipe,
    1F1B and interleaved 1F1B keep theirs for any forward and backward cost. ZB-H1's holds for
    m >= p with a weight pass no slower than the forward and the input-gradient pass; otherwise
    the deferred weight passes, not the ramp, set the critical path.
    """
    p, m, v = arguments.stages, arguments.microbatches, arguments.virtual_stages
    if arguments.schedule in ("gpipe", "1f1b"):
        return ClosedForm("(p-1)/(m+p-1)", (p - 1) / (m + p - 1))
    if arguments.schedule == "interleaved":
        return ClosedForm("(p-1)/(v*m+p-1)", (p - 1) / (v * m + p - 1))
    forward, inputs, weight = arguments.forward, arguments.backward_input, arguments.backward_weight
    if m < p or weight > min(forward, inputs):
        return None
    idle = (p - 1) * (forward + inputs - weight)
    return ClosedForm("(p-1)(F+I-W)/(m(F+I+W)+(p-1)(F+I-W))", idle / (m * (forward + inputs + weight) + idle))


def describe_costs(arguments: argparse.Namespace) -> str:
    if arguments.schedule == "zero_bubble":
        costs = {"F": arguments.forward, "I": arguments.backward_input, "W": arguments.backward_weight}
    else:
        costs = {"F": arguments.forward, "B": arguments.backward}
    return " ".join(f"{name}={cost:g}" for name, cost in costs.items())


def chunk_color(action_type: str, chunk: int, chunks: int):
    """The action's color, paler for later model chunks so virtual stages stay apart."""
    paleness = 0.55 * chunk / chunks
    return tuple(channel + (1 - channel) * paleness for channel in to_rgb(ACTION_COLORS[action_type]))


def draw_timeline(simulation, title: str, path: pathlib.Path) -> None:
    ranks, makespan = simulation.ranks, simulation.makespan
    chunks = simulation.stages // ranks
    shortest = min(timed.end - timed.start for row in simulation.timeline for timed in row)
    # Wide enough that the shortest action's box still holds its number.
    width_inches = min(48.0, max(8.0, 0.3 * makespan / shortest))
    figure = Figure(figsize=(width_inches, 1.6 + 0.45 * ranks))
    FigureCanvasAgg(figure)  # Agg without pyplot: no GUI backend, no global figure state
    axes = figure.add_subplot()
    points_per_time_unit = 0.85 * width_inches * 72 / makespan
    types_seen = []
    for rank, row in enumerate(simulation.timeline):
        for timed in row:
            action = timed.action
            kind = action.type.name
            if kind not in types_seen:
                types_seen.append(kind)
            duration = timed.end - timed.start
            axes.barh(rank, duration, left=timed.start, height=0.8, edgecolor="white", linewidth=0.5,
                      color=chunk_color(kind, action.stage // ranks, chunks))
            label = str(action.microbatch)
            box_points = duration * points_per_time_unit
            axes.text(timed.start + duration / 2, rank, label, ha="center", va="center", color="white",
                      fontsize=min(9.0, box_points / (0.7 * len(label) + 0.4)))
    axes.set_xlim(0, makespan)
    axes.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top, as in the printed grid
    axes.set_yticks(range(ranks), [f"rank {rank}" for rank in range(ranks)])
    axes.set_xlabel("time (units of the action costs)")
    axes.set_title(title)
    legend = [Patch(color=ACTION_COLORS[kind], label=f"{kind}: {ACTION_MEANINGS[kind]}") for kind in types_seen]
    if chunks > 1:
        legend.append(Patch(color="none", label="paler: later virtual stages"))
    axes.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_arguments(argv: Optional[Sequence[str]]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m torchpar.pipeline.show", description=__doc__.splitlines()[0])
    parser.add_argument("schedule", choices=engine.schedule_names())
    parser.add_argument("--stages", type=int, default=4, help="pipeline ranks p (default 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step m (default 8)")
    parser.add_argument("--virtual-stages", type=int, default=1,
                        help="model chunks per rank v, interleaved only (default 1)")
    parser.add_argument("--forward", type=float, default=1.0, help="cost of a forward pass F (default 1)")
    parser.add_argument("--backward", type=float, default=2.0, help="cost of a full backward pass B (default 2)")
    parser.add_argument("--backward-input", type=float, default=1.0,
                        help="cost of an input-gradient pass I, zero_bubble only (default 1)")
    parser.add_argument("--backward-weight", type=float, default=1.0,
                        help="cost of a weight-gradient pass W, zero_bubble only (default 1)")
    parser.add_argument("--png", type=pathlib.Path,
                        help="where to write the timeline (default pipeline_<schedule>_p<stages>_m<microbatches>.png)")
    return parser, parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser, arguments = parse_arguments(argv)
    p, m, v = arguments.stages, arguments.microbatches, arguments.virtual_stages
    try:
        simulation = engine.simulate(arguments.schedule, p, m, v, forward=arguments.forward,
                                     backward=arguments.backward, backward_input=arguments.backward_input,
                                     backward_weight=arguments.backward_weight)
    except RuntimeError as error:
        parser.error(str(error))

    shape = f"{p} ranks, {m} micro-batches"
    if v > 1:
        shape += f", {v} virtual stages per rank ({simulation.stages} stages)"
    print(f"{arguments.schedule}: {shape}; costs {describe_costs(arguments)}")
    print(simulation.grid(), end="")
    print(f"makespan: {simulation.makespan:g}")
    bubble = f"bubble fraction: {simulation.bubble_fraction:.4f} (simulated)"
    form = closed_form(arguments)
    if form is None:
        bubble += "; no closed form for these micro-batches and costs"
    else:
        bubble += f"; closed form {form.formula} = {form.bubble:.4f}"
    print(bubble)
    peaks = ", ".join(f"rank {rank}: {peak}" for rank, peak in enumerate(simulation.peak_activations))
    print(f"peak activations alive (stage, micro-batch pairs): {peaks}")

    path = arguments.png or pathlib.Path(f"pipeline_{arguments.schedule}_p{p}_m{m}.png")
    title = f"{arguments.schedule}, p={p} m={m}" + (f" v={v}" if v > 1 else "")
    title += f", costs {describe_costs(arguments)}"
    title += f"\nbubble {simulation.bubble_fraction:.1%}"
    if form is not None:
        title += f", closed form {form.formula} = {form.bubble:.1%}"
    draw_timeline(simulation, title, path)
    print(f"wrote {path.resolve()}")


if __name__ == "__main__":
    main()
