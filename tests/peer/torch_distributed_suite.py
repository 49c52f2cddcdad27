"""PyTorch's own backend test suite (``torch.testing._internal.distributed.distributed_test``), driven the
way PyTorch's ``test/distributed/test_distributed_spawn.py`` drives it, for any backend torch.distributed
knows once torchpar is imported — ``gloo`` and torchpar's ``shm`` side by side.

Run by ``tests/peer/run.py`` (which chooses the tests and compares the backends); on its own::

    BACKEND=shm WORLD_SIZE=2 python tests/peer/torch_distributed_suite.py --results out.json test_all_reduce_sum

Every rank is forked from this process after the module-level ``import torchpar``, which registered
``shm`` with torch.distributed.
With ``TORCHPAR_PEER_DDP=1`` torch's ``DistributedDataParallel`` is replaced by torchpar's everywhere the
suite can reach it, so torch's DDP tests run against torchpar's DDP.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import unittest

import torch
import torch.nn.parallel

import torchpar

BACKEND = os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())
SWAP_DDP = os.environ.get("TORCHPAR_PEER_DDP") == "1"

# The suite selects its tests by backend name when it is imported (decorators such as
# require_backend_is_available({"gloo"}) or skip_if(BACKEND != "gloo")), so a backend it does not
# know would skip most of what Gloo runs. shm stands in for Gloo (CPU tensors, same ops): the module
# is imported as for Gloo, then every rank initialises its groups with shm — the name the suite reads
# at run time. Checks made inside a test's body then see "shm".
STANDS_IN_FOR = "gloo"
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

if BACKEND != STANDS_IN_FOR:
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add(BACKEND)

if SWAP_DDP:
    torch.nn.parallel.DistributedDataParallel = torchpar.DistributedDataParallel

os.environ["BACKEND"] = STANDS_IN_FOR
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

os.environ["BACKEND"] = distributed_test.BACKEND = BACKEND
if SWAP_DDP:
    distributed_test.DistributedDataParallel = torchpar.DistributedDataParallel


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()  # a fresh temporary folder and rendezvous file for this test (in INIT_METHOD)
        # A spawned rank would read INIT_METHOD afresh when it imports the suite; a forked one has the
        # module's copy.
        distributed_test.INIT_METHOD = os.environ["INIT_METHOD"]
        # Forked, not spawned as upstream does for CUDA's sake: these runs are CPU-only, and a forked
        # rank skips re-importing torch and the suite (seconds per rank and test on a small machine).
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


TestDistBackendWithSpawn.__name__ = TestDistBackendWithSpawn.__qualname__ = f"TestDistBackendWithSpawn{BACKEND.upper()}"
globals()[TestDistBackendWithSpawn.__name__] = TestDistBackendWithSpawn


class RecordingResult(unittest.TextTestResult):
    """Keeps every test's outcome, its message and its duration."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict] = {}
        self._started = 0.0

    def startTest(self, test):
        self._started = time.monotonic()
        super().startTest(test)

    def _record(self, test, outcome, message=""):
        self.outcomes[test._testMethodName] = {
            "outcome": outcome,
            "message": message[-4000:],
            "seconds": round(time.monotonic() - self._started, 2),
        }

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "failed", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "failed", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "passed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", help="JSON file for every test's outcome")
    parser.add_argument("--list", action="store_true", help="print the suite's test names and exit")
    parser.add_argument("tests", nargs="*", help="test method names of DistributedTest._DistTestBase")
    args = parser.parse_args()
    if args.list:
        print("\n".join(name for name in dir(TestDistBackendWithSpawn) if name.startswith("test_")))
        return 0
    if not args.results or not args.tests:
        parser.error("--results and at least one test name are needed")
    suite = unittest.TestSuite(TestDistBackendWithSpawn(name) for name in args.tests)
    runner = unittest.TextTestRunner(resultclass=RecordingResult, verbosity=2, stream=sys.stderr)
    result = runner.run(suite)
    with open(args.results, "w") as out:
        json.dump(result.outcomes, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
