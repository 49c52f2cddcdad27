"""python -m torchpar.bench: every benchmark, each with its anchor in the same run, into one report.

    python -m torchpar.bench [collectives ddp sharded pipeline ps tp allocator plan | all] [--quick]
                              [--out benchmarks/results]

Runs the scripts under benchmarks/ (each stays runnable on its own; `plan` runs ``python -m torchpar.plan`` with
--verify on the deep MLP) one after the other, then writes <out>/report.md and report.html: the machine (CPU,
cores, memory, torch version), every benchmark's tables and plots, and a comparison with the previous report in
the same folder (run with the same --quick) — every ratio column (a header with "/", "ratio" or "speed-up") of
every row, flagged when it fell by more than 10%. --quick runs each benchmark's short form (about 6 minutes in
all on 2 cores).
Needs a source checkout (the benchmarks are not part of the installed package).
"""
from __future__ import annotations

import argparse
import datetime
import html
import json
import logging
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

import torch

logger = logging.getLogger("torchpar.bench")
ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
REGRESSION = 0.10  # a ratio that falls by more than this against the previous report is flagged


def commands(name: str, quick: bool, out: pathlib.Path) -> list[str]:
    """The command line of benchmark `name`, writing under `out`."""
    script = lambda file: [sys.executable, str(BENCHMARKS / file), "--out", str(out)]
    if name == "collectives":
        return script("collectives.py") + (["--worlds", "2", "--max-bytes", "4MiB"] if quick else [])
    if name == "plan":
        return [sys.executable, "-m", "torchpar.plan", "--model", "torchpar.plan.examples:deep_mlp",
                "--batch", "64", "--world", "2", "--verify", "2", "--verify-each-strategy", "--out", str(out / "plan")]
    file = {"ddp": "ddp.py", "sharded": "sharded.py", "pipeline": "pipeline.py", "ps": "ps.py",
            "tp": "tensor_parallel.py", "allocator": "allocator.py"}[name]
    extra = {"ddp": ["--worlds", "2"], "sharded": ["--worlds", "2"], "pipeline": ["--worlds", "2"]}.get(name, []) \
        if quick else []
    return script(file) + extra + (["--quick"] if quick else [])


SECTIONS = {
    "collectives": ("Collectives: shm vs Gloo", ["collectives.png"]),
    "ddp": ("DDP: torchpar vs torch's DistributedDataParallel", ["ddp.png"]),
    "sharded": ("Sharded data parallelism (ZeRO 1-3): torchpar vs torch's ZeRO and FSDP2", ["sharded.png"]),
    "pipeline": ("Pipeline: torchpar vs torch.distributed.pipelining", ["pipeline.png"]),
    "ps": ("Parameter server: torchpar vs the torch.distributed.rpc pattern", ["ps.png"]),
    "tp": ("Tensor parallelism: torchpar vs torch.distributed.tensor.parallel", ["tensor_parallel.png"]),
    "allocator": ("CPU memory between steps: torchpar's block cache vs glibc", ["allocator.png"]),
    "plan": ("Planner: predicted vs measured", ["plan/plan.png"]),
}


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        memory = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        memory = 0
    return dict(cpu=cpu, cores=os.cpu_count(), memory_gib=round(memory / 2**30, 1), torch=torch.__version__,
                python=platform.python_version(), host=platform.node())


def tables_in(output: str) -> list[list[str]]:
    """The markdown tables a benchmark printed, each as its lines."""
    tables, current = [], []
    for line in output.splitlines():
        if line.startswith("|"):
            current.append(line.rstrip())
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def verified_table(path: pathlib.Path) -> list[list[str]]:
    """The planner's --verify rows (its own output is not markdown)."""
    if not path.exists():
        return []
    rows = json.loads(path.read_text())["verified"]
    lines = ["| configuration | predicted ms | measured ms | error | calibrated ms | resident per rank predicted "
             "| measured | tensors per rank predicted | measured |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        error = abs(row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]
        lines.append(f"| {row['configuration']} | {row['predicted_ms']:.2f} | {row['measured_ms']:.2f} "
                     f"| {100 * error:.0f}% | {row['calibrated_ms']:.2f} | {row['predicted_memory'] / 2**20:.1f} MiB "
                     f"| {row['measured_memory'] / 2**20:.1f} MiB | {row['predicted_tensor_memory'] / 2**20:.1f} MiB "
                     f"| {row['measured_allocated'] / 2**20:.1f} MiB |")
    return [lines] if rows else []


def ratios(section: str, tables: list[list[str]]) -> dict[str, float]:
    """Every ratio cell, keyed by section, table, row (its position and first cell) and column: the same
    benchmark with the same options prints the same rows in the same order."""
    found = {}
    for index, table in enumerate(tables):
        header = [cell.strip() for cell in table[0].strip("|").split("|")]
        columns = [i for i, name in enumerate(header) if "/" in name or "ratio" in name or "speed-up" in name]
        for position, row in enumerate(table[2:], 1):
            cells = [cell.strip() for cell in row.strip("|").split("|")]
            for column in columns:
                match = re.match(r"([\d.]+)", cells[column]) if column < len(cells) else None
                if match:
                    found[f"{section} #{index + 1} row {position}: {cells[0]} | {header[column]}"] = float(match[1])
    return found


def comparison(now: dict[str, float], before: dict[str, float]) -> list[str]:
    lines = []
    for key in sorted(set(now) & set(before)):
        change = now[key] / before[key] - 1 if before[key] else 0.0
        if change < -REGRESSION:
            lines.append(f"| {key} | {before[key]:.2f} | {now[key]:.2f} | {100 * change:+.0f}% **regression** |")
    return lines


def write_html(markdown: str, path: pathlib.Path) -> None:
    """The report as one page: headings, tables and images; other lines as paragraphs."""
    body, table = [], []

    def flush_table():
        if table:
            rows = [[cell.strip() for cell in line.strip("|").split("|")]
                    for line in table if not set(line) <= set("|-: ")]
            cell = lambda tag, text: f"<{tag}>{html.escape(text)}</{tag}>"
            body.append("<table>" + "".join("<tr>" + "".join(cell("th" if i == 0 else "td", c) for c in row) + "</tr>"
                                            for i, row in enumerate(rows)) + "</table>")
            table.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush_table()
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line.lstrip('# '))}</h{level}>")
        elif (image := re.fullmatch(r"!\[(.*)\]\((.*)\)", line)):
            body.append(f'<img alt="{html.escape(image[1])}" src="{html.escape(image[2])}" style="max-width:100%">')
        elif line.strip():
            body.append(f"<p>{html.escape(line)}</p>")
    flush_table()
    style = "body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse}" \
            "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}"
    path.write_text(f"<!doctype html><meta charset=utf-8><title>torchpar benchmarks</title><style>{style}</style>"
                    + "\n".join(body))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m torchpar.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # Checked here, not by argparse's choices, which refuse an empty list (Python 3.11).
    parser.add_argument("benchmarks", nargs="*", help=f"any of {', '.join(SECTIONS)}; default: all")
    parser.add_argument("--quick", action="store_true", help="each benchmark's short form (~6 minutes in all)")
    parser.add_argument("--out", type=pathlib.Path, default=BENCHMARKS / "results")
    args = parser.parse_args(argv)
    unknown = [name for name in args.benchmarks if name not in (*SECTIONS, "all")]
    if unknown:
        parser.error(f"no benchmark {', '.join(unknown)}: choose from {', '.join(SECTIONS)} or all")
    return args


def selected(requested: list[str]) -> list[str]:
    """The benchmarks to run, in the report's order: all of them for none or "all"."""
    return [name for name in SECTIONS if not requested or "all" in requested or name in requested]


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not BENCHMARKS.is_dir():
        logger.error("no benchmarks/ beside the torchpar package (%s): the suite runs from a source checkout", ROOT)
        return 2
    names = selected(args.benchmarks)
    args.out.mkdir(parents=True, exist_ok=True)
    previous_path = args.out / "report.json"
    previous = json.loads(previous_path.read_text()) if previous_path.exists() else None
    sections, all_ratios, failed = [], {}, []
    start = time.perf_counter()
    from tqdm import tqdm

    for name in tqdm(names, desc="benchmarks", unit="benchmark"):
        began = time.perf_counter()
        result = subprocess.run(commands(name, args.quick, args.out), capture_output=True, text=True, cwd=ROOT)
        output = result.stdout + result.stderr
        (args.out / f"{name}.log").write_text(output)
        if result.returncode != 0:
            failed.append(name)
            logger.error("%s failed (exit code %d); its output is in %s", name, result.returncode,
                         args.out / f"{name}.log")
        tables = tables_in(output) + (verified_table(args.out / "plan" / "plan.json") if name == "plan" else [])
        summary = [line for line in output.splitlines()
                   if re.search(r"target|lowest|median|faster|measured \d", line) and not line.startswith("|")]
        all_ratios.update(ratios(name, tables))
        sections.append(dict(name=name, tables=tables, summary=summary, seconds=time.perf_counter() - began,
                             failed=result.returncode != 0))
    info = machine()
    quick = " (--quick)" if args.quick else ""
    placement = ("pinned to their share of the cores" if os.environ.get("TORCHPAR_BIND_CORES") == "1"
                 else "placed by the scheduler")
    lines = [f"# torchpar benchmarks, {datetime.datetime.now():%Y-%m-%d %H:%M}{quick}", "",
             f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB; torch {info['torch']}, "
             f"Python {info['python']}. Every benchmark runs its anchor in the same processes; ratios are medians "
             f"of per-round ratios. Ranks {placement} (TORCHPAR_BIND_CORES; the tensor-parallel benchmark's never "
             f"pinned).", ""]
    if previous is None:
        lines += ["No previous report in this folder to compare with.", ""]
    elif previous.get("quick") != args.quick:
        lines += [f"The previous report ({previous['date']}) was {'not ' if args.quick else ''}a --quick run: "
                  "its rows are not these, so it is not compared.", ""]
    else:
        regressions = comparison(all_ratios, previous["ratios"])
        lines += [f"Against the previous report ({previous['date']}): "
                  + (f"{len(regressions)} ratio(s) fell by more than {100 * REGRESSION:.0f}%:" if regressions
                     else f"no ratio fell by more than {100 * REGRESSION:.0f}%."), ""]
        if regressions:
            lines += ["| ratio | before | now | change |", "| --- | ---: | ---: | --- |", *regressions, ""]
    for section in sections:
        title, images = SECTIONS[section["name"]]
        outcome = f", FAILED: see {section['name']}.log" if section["failed"] else ""
        command = " ".join(commands(section["name"], args.quick, args.out)[1:])
        lines += [f"## {title}", "", f"`{command}` ({section['seconds']:.0f} s{outcome})", ""]
        for table in section["tables"]:
            lines += table + [""]
        lines += section["summary"] + [""]
        lines += [f"![{title}]({image})" for image in images if (args.out / image).exists()] + [""]
    report = "\n".join(lines)
    (args.out / "report.md").write_text(report)
    write_html(report, args.out / "report.html")
    # A partial run keeps the other benchmarks' last ratios for the next comparison.
    kept = {**(previous["ratios"] if previous and previous.get("quick") == args.quick else {}), **all_ratios}
    previous_path.write_text(json.dumps(dict(date=f"{datetime.datetime.now():%Y-%m-%d %H:%M}", machine=info,
                                             quick=args.quick, ratios=kept), indent=1))
    logger.info("wrote %s and %s in %.0f s%s", args.out / "report.md", args.out / "report.html",
                time.perf_counter() - start, f"; failed: {', '.join(failed)}" if failed else "")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
