"""Parameter-server training: parameters live on server ranks, workers push gradients and pull values.

    torchpar.init_process_group()                 # under torchrun
    service = torchpar.ps.ParameterService(servers=1, consistency="ssp", staleness=2)
    if service.is_server:
        service.serve()                           # until every worker finished
    else:
        params = torchpar.ps.RemoteParameters(model, service.client, torchpar.ps.SGD(lr=0.1, momentum=0.9))
        for x, y in data:
            loss_fn(model(x), y).backward()       # each gradient is pushed as soon as it is ready
            params.step()                         # the servers' new values land in the model
        service.finish()

The last ``servers`` ranks serve (or ``TORCHPAR_PS_SERVERS``); the others train. Dense tables are split
over the servers in contiguous ranges; sparse tables (``Embedding``) by a hash of the row id, rows created
on first touch. Consistency: ``bsp`` (a server applies the mean of every live worker's gradient for a
clock, then releases the next), ``asp`` (each push applied at once), ``ssp`` (a read waits while its
worker is more than ``staleness`` clocks ahead of the slowest live worker). The client's operations
return ``torch.futures.Future``s; each is one message per server however many tables it names.
"""
from __future__ import annotations

import datetime
import logging
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from torchpar._C import ps as _engine

logger = logging.getLogger("torchpar.ps")

__all__ = [
    "Adagrad",
    "Adam",
    "Client",
    "Embedding",
    "ParameterService",
    "RemoteParameters",
    "SGD",
    "initial_rows",
    "normal",
    "uniform",
    "zeros",
]

Client = _engine.Client
initial_rows = _engine.initial_rows
zeros = _engine.RowInitializer.zeros
uniform = _engine.RowInitializer.uniform
normal = _engine.RowInitializer.normal


def SGD(lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> _engine.OptimizerConfig:
    """Server-side torch.optim.SGD (dense tables; sparse rows take plain SGD only)."""
    return _engine.OptimizerConfig.sgd(lr, momentum, weight_decay)


def Adagrad(lr: float, eps: float = 1e-10, initial_accumulator_value: float = 0.0,
            weight_decay: float = 0.0) -> _engine.OptimizerConfig:
    """Server-side torch.optim.Adagrad; on sparse rows the sum of squares is kept per row."""
    config = _engine.OptimizerConfig.adagrad(lr, eps, initial_accumulator_value)
    config.weight_decay = weight_decay
    return config


def Adam(lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0) -> _engine.OptimizerConfig:
    """Server-side torch.optim.Adam; on sparse rows moments and step count are kept per row."""
    config = _engine.OptimizerConfig.adam(lr, betas[0], betas[1], eps)
    config.weight_decay = weight_decay
    return config


def _log(warning: bool, line: str) -> None:
    (logger.warning if warning else logger.info)(line)


def _seconds(timeout: Union[None, float, datetime.timedelta]) -> Optional[float]:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return timeout


class ParameterService:
    """The parameter service over ``process_group`` (default: the whole world); every rank constructs it.

    Servers are the last ``servers`` ranks (default ``TORCHPAR_PS_SERVERS``, else 1). ``checkpoint_dir``:
    servers restore from it at start and write to it on ``client.checkpoint()``, every
    ``checkpoint_every`` clocks and at the end. ``timeout`` (seconds or timedelta; default
    ``TORCHPAR_TIMEOUT``, else 30 min) bounds every request and, under BSP, how long a round waits for a
    worker before dropping it. ``stats_interval``: seconds between the servers' statistics lines.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *, servers: Optional[int] = None,
                 consistency: str = "bsp", staleness: int = 0, checkpoint_dir: Optional[str] = None,
                 checkpoint_every: int = 0, timeout: Union[None, float, datetime.timedelta] = None,
                 stats_interval: float = 30.0, worker_backend: str = ""):
        if process_group is None:
            if not dist.is_initialized():
                raise RuntimeError("torchpar.ps.ParameterService needs a process group: call "
                                   "torchpar.init_process_group() (or torch.distributed's) first")
            process_group = dist.group.WORLD
        self._service = _engine.ParameterService(
            process_group, servers or 0, consistency, staleness, str(checkpoint_dir or ""), checkpoint_every,
            _seconds(timeout), stats_interval, worker_backend, _log)

    is_server = property(lambda self: self._service.is_server)
    server_index = property(lambda self: self._service.server_index)
    worker_index = property(lambda self: self._service.worker_index)
    num_servers = property(lambda self: self._service.num_servers)
    num_workers = property(lambda self: self._service.num_workers)

    @property
    def client(self) -> Client:
        return self._service.client()

    @property
    def worker_group(self) -> Optional[dist.ProcessGroup]:
        """A process group over the workers only (None on servers): evaluation, metrics, DDP."""
        return self._service.worker_group

    def serve(self) -> dict:
        """Servers: run until every worker finished or was lost; returns the server's statistics."""
        return self._service.serve()

    def finish(self) -> None:
        """Workers: tell the servers this worker is done."""
        self._service.finish()

    def close(self) -> None:
        """Finish (workers) and drop this object's hold on the service: its threads and groups go with
        the last reference (a ``RemoteParameters`` or ``Embedding`` holding the client keeps them)."""
        if self._service is not None:
            self._service.finish()
            self._service = None


class RemoteParameters:
    """A module's parameters kept on the parameter servers, one dense table each (``prefix`` + name).

    Gradients are pushed in buckets of about ``bucket_cap_mb`` (parameters in reverse order, as DDP's
    buckets: roughly the order backward produces them), each with a pull of the new values, as soon as
    backward has accumulated every gradient of the bucket — so communication overlaps the rest of
    backward, and a bucket is one message per server. ``step()`` waits for the values and writes them
    into the parameters. Worker 0's values start the tables, or the servers' checkpoint after a
    restart; every worker's module starts from the servers' values. Parameters that do not require
    grad stay local. The engine is C++'s ``torchpar::ps::RemoteParameters``.
    """

    def __init__(self, module: nn.Module, client: Client, optimizer: _engine.OptimizerConfig, prefix: str = "",
                 bucket_cap_mb: float = 25.0):
        named = list(module.named_parameters())
        self._engine = _engine.RemoteParameters(client, [name for name, _ in named], [p for _, p in named],
                                                optimizer, prefix, int(bucket_cap_mb * 2**20))

    @property
    def clock(self) -> int:
        """Steps taken (counted from the servers' checkpoint after a restore)."""
        return self._engine.clock

    @property
    def buckets(self) -> list[list[str]]:
        """The parameters' names, bucket by bucket, in the order backward pushes them."""
        return self._engine.buckets

    def step(self) -> None:
        """Sends what backward has not, waits for the servers' new values and writes them into the module."""
        self._engine.step()

    def pull(self) -> None:
        """Copies the servers' current values into the parameters."""
        self._engine.pull()

    def set_learning_rate(self, lr: float) -> None:
        self._engine.set_learning_rate(lr)

    def remove(self) -> None:
        """Stops pushing from backward (removes the gradient hooks); ``step()`` then pushes everything."""
        self._engine.remove_hooks()


class Embedding(nn.Module):
    """``nn.Embedding(num_rows, dim)`` whose rows live on the parameter servers (a sparse table ``name``).

    forward pulls the batch's rows (each distinct id once); backward pushes their gradients, duplicates
    summed; the servers' row-wise optimizer updates them. Rows are created on first touch by
    ``initializer``, so the servers hold only rows some batch used, however large ``num_rows`` is.
    The engine is C++'s ``torchpar::ps::Embedding``.
    """

    def __init__(self, client: Client, name: str, num_rows: int, dim: int,
                 optimizer: Optional[_engine.OptimizerConfig] = None,
                 initializer: Optional[_engine.RowInitializer] = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self._client = client
        self.num_rows, self.dim = num_rows, dim
        self._engine = _engine.Embedding(client, name, num_rows, dim, optimizer or Adagrad(0.1),
                                         initializer or zeros(), dtype)
        self.table = self._engine.table

    def flush(self) -> None:
        """Waits for every push of the backwards so far; the first failed one's error is raised here."""
        self._engine.flush()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._engine.forward(ids, self.training)

    def extra_repr(self) -> str:
        return f"{self.num_rows}, {self.dim}, table={self._client.table_name(self.table)!r}"
