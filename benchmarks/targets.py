"""The targets a benchmark's figures are held to (issue 16), printed as a table with which hold."""
from __future__ import annotations

from typing import NamedTuple


class Target(NamedTuple):
    name: str          # "torchpar/torch >= 1.10 (median of the rows)"
    measured: str      # the figure the target reads, as printed: "1.02"
    holds: bool


def at_least(name: str, value: float, bound: float) -> Target:
    return Target(f"{name} >= {bound:g}", f"{value:.2f}", value >= bound)


def at_most(name: str, value: float, bound: float) -> Target:
    return Target(f"{name} <= {bound:g}", f"{value:.2f}", value <= bound)


def table(targets: list[Target]) -> str:
    lines = ["| target | measured | holds |", "| --- | ---: | --- |"]
    lines += [f"| {t.name} | {t.measured} | {'yes' if t.holds else 'no'} |" for t in targets]
    return "\n".join(lines)
