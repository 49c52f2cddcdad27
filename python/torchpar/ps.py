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
import threading
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
    restart; every worker's module starts from the servers' values.
    """

    def __init__(self, module: nn.Module, client: Client, optimizer: _engine.OptimizerConfig, prefix: str = "",
                 bucket_cap_mb: float = 25.0):
        self._client = client
        self._parameters = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._tables = [client.dense_table(prefix + name, p.detach(), optimizer) for name, p in self._parameters]
        self._buckets: list[list[int]] = []
        bucket, bucket_bytes = [], 0
        for index in reversed(range(len(self._parameters))):
            parameter = self._parameters[index][1]
            bucket.append(index)
            bucket_bytes += parameter.numel() * parameter.element_size()
            if bucket_bytes >= bucket_cap_mb * 2**20:
                self._buckets.append(bucket)
                bucket, bucket_bytes = [], 0
        if bucket:
            self._buckets.append(bucket)
        self._bucket_of = {index: b for b, bucket in enumerate(self._buckets) for index in bucket}
        self._ready: dict[int, torch.Tensor] = {}
        self._in_flight: dict[int, torch.futures.Future] = {}
        self._lock = threading.Lock()  # hooks may run on several autograd threads (one per device)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, (_, p) in
                       enumerate(self._parameters)]
        self.pull()

    def _hook(self, index: int):
        def gradient_ready(parameter: torch.Tensor) -> None:
            with self._lock:
                if index in self._ready:
                    raise RuntimeError(f"RemoteParameters: parameter '{self._parameters[index][0]}' got a second "
                                       "gradient before step(); call step() after each backward")
                self._ready[index] = parameter.grad
                bucket = self._bucket_of[index]
                if bucket not in self._in_flight and all(i in self._ready for i in self._buckets[bucket]):
                    self._launch(bucket)
        return gradient_ready

    def _launch(self, bucket: int) -> None:
        indices = self._buckets[bucket]
        grads = [self._ready.get(i) for i in indices]
        # A parameter without a gradient pushes zeros: every table ticks every clock.
        grads = [g if g is not None else torch.zeros_like(self._parameters[i][1]) for g, i in zip(grads, indices)]
        self._in_flight[bucket] = self._client.push_pull([self._tables[i] for i in indices], grads)

    @property
    def clock(self) -> int:
        """Steps taken (counted from the servers' checkpoint after a restore)."""
        return min(self._client.clock(t) for t in self._tables) if self._tables else 0

    def step(self) -> None:
        """Sends what backward has not, waits for the servers' new values and writes them into the module."""
        for bucket in range(len(self._buckets)):
            if bucket not in self._in_flight:
                for index in self._buckets[bucket]:
                    if index not in self._ready:
                        self._ready[index] = self._parameters[index][1].grad
                self._launch(bucket)
        in_flight, self._in_flight = self._in_flight, {}
        self._ready.clear()
        with torch.no_grad():
            for bucket, future in sorted(in_flight.items()):
                for index, value in zip(self._buckets[bucket], future.wait()):
                    _, parameter = self._parameters[index]
                    parameter.copy_(value)
                    parameter.grad = None

    def pull(self) -> None:
        """Copies the servers' current values into the parameters."""
        values = self._client.pull(self._tables).wait()
        with torch.no_grad():
            for (_, parameter), value in zip(self._parameters, values):
                parameter.copy_(value)

    def set_learning_rate(self, lr: float) -> None:
        for table in self._tables:
            self._client.set_learning_rate(table, lr)

    def remove(self) -> None:
        """Stops pushing from backward (removes the gradient hooks)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class Embedding(nn.Module):
    """``nn.Embedding(num_rows, dim)`` whose rows live on the parameter servers (a sparse table ``name``).

    forward pulls the batch's rows (each distinct id once); backward pushes their gradients, duplicates
    summed; the servers' row-wise optimizer updates them. Rows are created on first touch by
    ``initializer``, so the servers hold only rows some batch used, however large ``num_rows`` is.
    """

    def __init__(self, client: Client, name: str, num_rows: int, dim: int,
                 optimizer: Optional[_engine.OptimizerConfig] = None,
                 initializer: Optional[_engine.RowInitializer] = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self._client = client
        self.num_rows, self.dim = num_rows, dim
        self.table = client.sparse_table(name, num_rows, dim, optimizer or Adagrad(0.1),
                                         initializer or zeros(), dtype)
        self._pushes: list[torch.futures.Future] = []

    def flush(self) -> None:
        """Waits for the pushes of the backwards so far; the first error, if any, is raised here."""
        pushes, self._pushes = self._pushes, []
        for push in pushes:
            push.wait()

    def _push(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        self._pushes.append(self._client.push_rows([self.table], [ids], [grad]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.flush()
        rows = self._client.pull_rows([self.table], [ids]).wait()[0]
        if self.training and torch.is_grad_enabled():
            rows.requires_grad_()
            batch_ids = ids.detach().cpu()
            rows.register_hook(lambda grad: self._push(batch_ids, grad))
        return rows

    def extra_repr(self) -> str:
        return f"{self.num_rows}, {self.dim}, table={self._client.table_name(self.table)!r}"
