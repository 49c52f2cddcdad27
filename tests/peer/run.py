"""PyTorch's distributed test suite against torchpar: every CPU test of torch's backend suite on ``gloo``
and on torchpar's ``shm`` in the same run, with 2 and 3 ranks, once more on ``shm`` under
``TORCH_DISTRIBUTED_DEBUG=DETAIL``, and torch's DDP tests with torchpar's ``DistributedDataParallel`` in
place of torch's. Fails when a test that passes on Gloo (with torch's DDP) does not pass in another
configuration and is not listed below with its reason, or when a listed test passes after all (so the
list stays true).

    python tests/peer/run.py                      # everything (about 6 minutes on 2 cores)
    python tests/peer/run.py --world-sizes 2 -k all_gather --configurations shm
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import fnmatch
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITE = HERE / "torch_distributed_suite.py"

# Tests needing GPUs or another backend by name never run here.
NOT_CPU = re.compile(r"cuda|nccl|gpu|_xpu|hpu", re.IGNORECASE)

# Rows of the summary table, first match wins.
CATEGORIES = [
    ("object collectives", r"_object"),
    ("barriers", r"^test_(barrier|monitored_barrier)"),
    ("send/recv", r"^test_(send_recv|isend|irecv|batch_isend_irecv)"),
    ("groups", r"^test_(new_subgroups|get_rank|destroy|get_backend|Backend_enum)"),
    (
        "DDP (CPU)",
        r"^test_(DistributedDataParallel|ddp_|accumulate_gradients|static_graph|grads_same|invalid_static_graph"
        r"|detect_ddp|different_graph|output_unused|undefined_grad|verify_model|skip_all_reduce|stateless_api"
        r"|sync_bn|SyncBatchNorm|compute_bucket|DistributedSampler|post_localSGD|periodic_model|average_param"
        r"|.*hierarchical|get_data_parallel|dump_DDP)",
    ),
    ("collectives", r"^test_"),
]
DDP_CATEGORY = "DDP (CPU)"


@dataclasses.dataclass(frozen=True)
class Configuration:
    name: str
    backend: str
    environment: tuple[tuple[str, str], ...] = ()
    ddp_only: bool = False  # runs the DDP tests only


CONFIGURATIONS = {
    "gloo": Configuration("gloo", "gloo"),
    "shm": Configuration("shm", "shm"),
    "shm-detail": Configuration("shm, DEBUG=DETAIL", "shm", (("TORCH_DISTRIBUTED_DEBUG", "DETAIL"),)),
    "ddp-gloo": Configuration("torchpar DDP, gloo", "gloo", (("TORCHPAR_PEER_DDP", "1"),), ddp_only=True),
    "ddp-shm": Configuration("torchpar DDP, shm", "shm", (("TORCHPAR_PEER_DDP", "1"),), ddp_only=True),
}
REFERENCE = "gloo"

# Tests that pass on Gloo but are not expected to pass in a configuration, each with the reason. A key is
# (configuration key or "*", test name pattern). Only reasons outside torchpar belong here: a defect of
# torchpar is fixed, not listed.
KNOWN_DIFFERENCES: dict[tuple[str, str], str] = {
    ("*shm*", "test_accumulate_gradients_no_sync*"): (
        "the test body builds its model only when BACKEND is 'gloo', 'mpi' or 'nccl' and otherwise fails with its "
        "own UnboundLocalError; the same accumulation under no_sync runs on shm in tests/python/test_ddp_features.py "
        "and in the 'torchpar DDP, gloo' configuration here"
    ),
    ("ddp-*", "test_ddp_logging_data_cpu"): (
        "reads torch DDP's C++ Logger (_set_ddp_runtime_logging_sample_rate, _get_ddp_logging_data), an internal "
        "of torch's implementation"
    ),
    ("ddp-*", "test_static_graph_api_cpu"): (
        "after checking the error (which torchpar raises with torch's wording) it reads torch DDP's C++ Logger "
        "(_get_ddp_logging_data), an internal of torch's implementation"
    ),
}


def category_of(test: str) -> str:
    return next(name for name, pattern in CATEGORIES if re.search(pattern, test))


def known_difference(configuration: str, test: str) -> str | None:
    for (configurations, pattern), reason in KNOWN_DIFFERENCES.items():
        if fnmatch.fnmatch(configuration, configurations) and fnmatch.fnmatch(test, pattern):
            return reason
    return None


def suite_tests() -> list[str]:
    listed = subprocess.run(
        [sys.executable, str(SUITE), "--list"], check=True, capture_output=True, text=True, env=suite_environment({})
    ).stdout.split()
    return [test for test in listed if not NOT_CPU.search(test)]


def suite_environment(extra: dict[str, str]) -> dict[str, str]:
    environment = dict(os.environ)
    for variable in ("TORCH_DISTRIBUTED_DEBUG", "TORCHPAR_PEER_DDP"):
        environment.pop(variable, None)
    environment.update(
        # The suite's barrier-timeout tests run with a file:// rendezvous only; each test then gets a
        # fresh file of its own.
        INIT_METHOD="file://",
        # A hang ends in 90 s rather than torch's default 300 s.
        DISTRIBUTED_TESTS_DEFAULT_TIMEOUT="90",
        PYTORCH_PRINT_REPRO_ON_FAILURE="0",
        OMP_NUM_THREADS="1",
    )
    environment.update(extra)
    return environment


def run_suite(configuration: Configuration, world_size: int, tests: list[str], log_dir: Path) -> dict[str, dict]:
    """Every test's outcome: passed, failed, skipped (with its message), or missing when the run died."""
    slug = re.sub(r"\W+", "-", configuration.name).strip("-")
    results = log_dir / f"{slug}-{world_size}.json"
    log = log_dir / f"{slug}-{world_size}.log"
    environment = suite_environment(
        dict(configuration.environment, BACKEND=configuration.backend, WORLD_SIZE=str(world_size))
    )
    with open(log, "w") as output:
        subprocess.run(
            [sys.executable, str(SUITE), "--results", str(results), *tests],
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
            timeout=3600,
        )
    outcomes = json.loads(results.read_text()) if results.exists() else {}
    for test in tests:
        outcomes.setdefault(test, {"outcome": "missing", "message": f"no result; see {log}", "seconds": 0})
    return outcomes


def compare(reference: dict[str, dict], other: dict[str, dict], configuration: str) -> tuple[list, list, list]:
    """(unexplained differences, listed differences, stale listings) of `other` against `reference`."""
    unexplained, listed, stale = [], [], []
    for test, expected in sorted(reference.items()):
        if test not in other or expected["outcome"] != "passed":
            continue
        reason = known_difference(configuration, test)
        passed = other[test]["outcome"] == "passed"
        if not passed and reason:
            listed.append((test, reason))
        elif not passed:
            unexplained.append((test, other[test]))
        elif reason:
            stale.append(test)
    return unexplained, listed, stale


def print_table(world_size: int, results: dict[str, dict[str, dict]]) -> None:
    names = list(results)
    print(f"\n{world_size} ranks: passed / failed / skipped")
    print("| tests | " + " | ".join(CONFIGURATIONS[name].name for name in names) + " |")
    print("| --- |" + " ---: |" * len(names))
    rows = [category for category, _ in CATEGORIES] + ["all"]
    for row in rows:
        cells = []
        for name in names:
            counts = collections.Counter(
                outcome["outcome"]
                for test, outcome in results[name].items()
                if row == "all" or category_of(test) == row
            )
            cells.append(f"{counts['passed']} / {counts['failed'] + counts['missing']} / {counts['skipped']}")
        if any(cell != "0 / 0 / 0" for cell in cells):
            print(f"| {row} | " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--configurations", nargs="+", choices=[c for c in CONFIGURATIONS if c != REFERENCE],
                        default=[c for c in CONFIGURATIONS if c != REFERENCE])
    parser.add_argument("-k", dest="pattern", help="only tests whose name contains this")
    parser.add_argument("--log-dir", type=Path, help="where each run's log and JSON go (default: a temporary folder)")
    args = parser.parse_args()

    tests = [test for test in suite_tests() if not args.pattern or args.pattern in test]
    if not tests:
        print("no test of the suite matches", file=sys.stderr)
        return 1
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="torchpar-peer-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"PyTorch's distributed suite: {len(tests)} CPU tests; logs in {log_dir}", flush=True)

    problems = 0
    for world_size in args.world_sizes:
        results: dict[str, dict[str, dict]] = {}
        for name in [REFERENCE, *args.configurations]:
            configuration = CONFIGURATIONS[name]
            selected = [t for t in tests if not configuration.ddp_only or category_of(t) == DDP_CATEGORY]
            started = time.monotonic()
            results[name] = run_suite(configuration, world_size, selected, log_dir)
            counts = collections.Counter(outcome["outcome"] for outcome in results[name].values())
            print(f"  {world_size} ranks, {configuration.name}: {counts['passed']} passed, "
                  f"{counts['failed'] + counts['missing']} failed, {counts['skipped']} skipped "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
        print_table(world_size, results)
        for name in args.configurations:
            unexplained, listed, stale = compare(results[REFERENCE], results[name], name)
            label = f"{world_size} ranks, {CONFIGURATIONS[name].name}"
            for test, reason in listed:
                print(f"  listed ({label}): {test}: {reason}")
            for test in stale:
                print(f"  STALE LISTING ({label}): {test} passes now; remove it from KNOWN_DIFFERENCES")
            for test, outcome in unexplained:
                print(f"  FAILED ({label}): {test} passes on gloo but is {outcome['outcome']} here:\n"
                      + "\n".join("      " + line for line in outcome["message"].strip().splitlines()[-12:]))
            problems += len(unexplained) + len(stale)
    if problems:
        print(f"\n{problems} problem(s)")
    else:
        print("\nOK: every test passing on gloo passes in every other configuration or is listed with its reason")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
