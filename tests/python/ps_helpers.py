"""Shared by the parameter-server tests: every rank builds the service; servers serve, workers run a body.

    def body(service, *args):          # module level; runs on each worker rank
        return service.client.pull([...]).wait()

    workers, servers = run_service(2, 1, body, consistency="asp")
    # workers: each worker's return value, by worker index; servers: each server's serve() statistics
"""
from __future__ import annotations

from typing import Any, Callable

from rank_harness import run_on_ranks

import torchpar.ps as ps


def serve_or_work(rank: int, world: int, servers: int, service_options: dict, body: Callable, *args) -> tuple:
    """One rank: constructs the service; servers serve, workers run ``body(service, *args)`` then finish."""
    service = ps.ParameterService(servers=servers, **service_options)
    if service.is_server:
        return ("server", service.server_index, service.serve())
    value = body(service, *args)
    service.finish()
    return ("worker", service.worker_index, value)


def run_service(workers: int, servers: int, body: Callable, *args, deadline_s: float = 180.0,
                collective_timeout_s: float = 120.0, **service_options) -> tuple[list[Any], list[dict]]:
    """Runs ``body`` on ``workers`` worker ranks next to ``servers`` server ranks.

    ``service_options`` go to ``ParameterService`` (consistency, staleness, timeout, ...); timeout defaults
    to 120 s and the statistics lines to once an hour. Returns (worker values, server statistics), each
    in index order."""
    service_options.setdefault("timeout", 120.0)
    service_options.setdefault("stats_interval", 3600.0)
    results = run_on_ranks(workers + servers, serve_or_work, servers, service_options, body, *args,
                           deadline_s=deadline_s, collective_timeout_s=collective_timeout_s)
    worker_values = sorted(((i, v) for role, i, v in results if role == "worker"), key=lambda item: item[0])
    server_stats = sorted(((i, v) for role, i, v in results if role == "server"), key=lambda item: item[0])
    assert [i for i, _ in worker_values] == list(range(workers))
    assert [i for i, _ in server_stats] == list(range(servers))
    return [v for _, v in worker_values], [v for _, v in server_stats]


def _serve_or_work_in_turn(rank: int, world: int, servers: int, scenarios: list) -> list:
    """One rank: one service after another on the same ranks (a launch costs far more than a service).

    A worker's failing body is caught and reported as its traceback, and the worker still finishes, so
    the servers return and the next scenarios run."""
    import traceback

    outcomes = []
    for name, body, args, options in scenarios:
        service = ps.ParameterService(servers=servers, **options)
        if service.is_server:
            outcomes.append(("server", service.server_index, service.serve()))
            continue
        try:
            outcome = ("worker", service.worker_index, body(service, *args))
        except Exception:  # noqa: BLE001 - reported to the test of this scenario
            outcome = ("failed", service.worker_index, f"scenario {name!r}:\n{traceback.format_exc()}")
        service.finish()
        outcomes.append(outcome)
    return outcomes


class Scenarios:
    """The outcomes of ``run_scenarios``: ``scenarios[name]`` is (worker values, server statistics), or
    raises AssertionError with the tracebacks of that scenario's failed workers."""

    def __init__(self, names: list[str], per_rank: list[list[tuple]]):
        self._outcomes = {name: [outcomes[i] for outcomes in per_rank] for i, name in enumerate(names)}

    def __getitem__(self, name: str) -> tuple[list[Any], list[dict]]:
        outcomes = self._outcomes[name]
        failures = [message for role, _, message in outcomes if role == "failed"]
        if failures:
            raise AssertionError("\n".join(failures))
        workers = [value for role, _, value in sorted(outcomes, key=lambda o: o[1]) if role == "worker"]
        servers = [value for role, _, value in sorted(outcomes, key=lambda o: o[1]) if role == "server"]
        return workers, servers


def run_scenarios(workers: int, servers: int, scenarios: list, deadline_s: float = 240.0,
                  collective_timeout_s: float = 120.0) -> Scenarios:
    """Runs ``scenarios`` — (name, body, args, service options) — one after another on one launch of
    ``workers`` + ``servers`` ranks, each with a fresh service (timeout 60 s unless given)."""
    scenarios = [(name, body, tuple(args), {"timeout": 60.0, "stats_interval": 3600.0, **options})
                 for name, body, args, options in scenarios]
    per_rank = run_on_ranks(workers + servers, _serve_or_work_in_turn, servers, scenarios, deadline_s=deadline_s,
                            collective_timeout_s=collective_timeout_s)
    return Scenarios([name for name, *_ in scenarios], per_rank)


# --- Failure tests: ranks that die on purpose, signals between ranks, the servers' log, raw messages ---

import logging  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import signal  # noqa: E402
import struct  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402


def kill_self() -> None:
    """Dies as kill -9 would kill this rank: no exception, no cleanup, its sockets closed by the kernel."""
    os.kill(os.getpid(), signal.SIGKILL)


def touch(path) -> None:
    """Raises a flag other ranks can wait for (a file: usable from any thread, whatever the store is doing)."""
    pathlib.Path(path).touch()


def wait_for(path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pathlib.Path(path).exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.02)


def kill_self_when(path, dying=None) -> None:
    """A thread that kills this rank once ``path`` exists (for a server blocked in serve()); it raises the
    flag ``dying`` first, if given."""
    def watch():
        wait_for(path, timeout_s=600)
        if dying is not None:
            touch(dying)
        kill_self()
    threading.Thread(target=watch, daemon=True).start()


class PsLog(logging.Handler):
    """The torchpar.ps log lines of this rank, kept in ``lines`` as (levelname, message). ``kill_on``: this rank
    dies (kill -9) right after emitting a line containing that text, inside the server loop that logged it."""

    def __init__(self, kill_on: str | None = None):
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []
        self.kill_on = kill_on
        logger = logging.getLogger("torchpar.ps")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.lines.append((record.levelname, message))
        if self.kill_on is not None and self.kill_on in message:
            kill_self()

    def warnings(self) -> list[str]:
        return [message for level, message in self.lines if level == "WARNING"]


def error_of(call: Callable) -> str:
    """The message of the RuntimeError that ``call()`` raises, directly or from the future it returns."""
    try:
        result = call()
        if isinstance(result, torch._C.Future):  # the client's futures (torch.futures.Future's base)
            result.wait()
    except RuntimeError as error:
        return str(error)
    raise AssertionError(f"no error from {getattr(call, '__name__', call)}")


def checkpoint_files(directory, servers: int) -> list[pathlib.Path]:
    return [pathlib.Path(directory) / f"server-{i}-of-{servers}.pt" for i in range(servers)]


def load_checkpoint(path) -> dict:
    """A server's checkpoint file, as torch.load reads it."""
    return torch.load(path, weights_only=False)


class Kind:
    """Request kinds (csrc/torchpar/ps/wire_format.h, MessageKind)."""
    REGISTER_DENSE, REGISTER_SPARSE, PULL, PUSH, PUSH_PULL, PULL_ROWS, PUSH_ROWS = 1, 2, 3, 4, 5, 6, 7
    SET_LEARNING_RATE, CHECKPOINT, FINISH = 8, 9, 10


DTYPE_CODE = {torch.float32: 1, torch.float64: 2}


class Payload:
    """A request body as csrc/torchpar/ps/messages.cpp encodes it: little-endian fields, tensor data aligned to
    8 bytes from the payload's start."""

    def __init__(self):
        self.data = bytearray()

    def u8(self, value):
        self.data += struct.pack("<B", value)
        return self

    def u32(self, value):
        self.data += struct.pack("<I", value)
        return self

    def i64(self, value):
        self.data += struct.pack("<q", value)
        return self

    def f64(self, value):
        self.data += struct.pack("<d", value)
        return self

    def string(self, text: str):
        encoded = text.encode()
        return self.u32(len(encoded)).bytes(encoded)

    def bytes(self, data):
        self.data += data
        return self

    def tensor(self, tensor: torch.Tensor):
        self.data += b"\0" * (-len(self.data) % 8)
        self.data += tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return self

    def to_tensor(self) -> torch.Tensor:
        if not self.data:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8)


def dense_payload(items) -> Payload:
    """Pull / Push / PushPull: items of (server table id, clock, dtype code, numel, data or None[, the
    table's shape as the worker sees it, by default [numel]])."""
    payload = Payload().u32(len(items))
    for table, clock, dtype, numel, data, *shape in items:
        shape = shape[0] if shape else [numel]
        payload.u32(table).i64(clock).u8(dtype).u32(len(shape))
        for size in shape:
            payload.i64(size)
        payload.i64(numel).u8(0)  # not read in place
        if data is not None:
            payload.tensor(data)
    return payload


def rows_payload(items) -> Payload:
    """PullRows / PushRows: items of (server table id, clock, dtype code, ids, dim, gradients or None)."""
    payload = Payload().u32(len(items))
    for table, clock, dtype, ids, dim, grads in items:
        payload.u32(table).i64(clock).u8(dtype).i64(len(ids)).i64(dim).tensor(torch.as_tensor(ids, dtype=torch.int64))
        if grads is not None:
            payload.tensor(grads)
    return payload
