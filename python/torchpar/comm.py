"""Process groups from a torchrun launch, with the same checks and messages as the C++ API."""
from __future__ import annotations

import datetime
import logging
import os

import torch.distributed as dist

from . import _C

LaunchError = _C.LaunchError
logger = logging.getLogger("torchpar")


def read_launch_config(rank: int | None = None, world_size: int | None = None, has_store: bool = False):
    """What torchrun put in the environment, validated; raises :class:`LaunchError`."""
    return _C.read_launch_config(dict(os.environ), rank, world_size, has_store)


def bind_cores(local_rank: int | None = None, local_world_size: int | None = None):
    """Pin this process (every thread, and those it starts later) to its local rank's share of the host's cores,
    and set torch's intra-op threads to one per physical core of the share; returns the share (``cpus``,
    ``threads``, ``pinned``).

    With at least as many physical cores as local ranks each rank gets a block of whole cores; with fewer, nothing
    is pinned (``pinned`` is False, and a warning says why). ``local_rank`` and ``local_world_size`` default to
    torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE. ``TORCHPAR_BIND_CORES=1`` makes :func:`init_process_group` call it
    first.
    """
    return _C.bind_cores(local_rank, local_world_size)


def init_process_group(
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """Initialise torch.distributed's default process group from a torchrun launch and return it.

    Same arguments and rules as C++ ``torchpar::init_process_group``: ``backend`` is "gloo",
    "nccl" or "cpu:gloo,cuda:nccl" (default ``TORCHPAR_BACKEND``, else "gloo"); ``timeout``
    defaults to ``TORCHPAR_TIMEOUT`` seconds, else 30 minutes; ``rank``/``world_size``/``store``
    serve programs not launched by torchrun. ``TORCHPAR_BIND_CORES=1`` pins the rank first
    (:func:`bind_cores`). A wrong launch raises :class:`LaunchError` with a
    one-line message; every rank returns only once all ranks have joined.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "torchpar.init_process_group: the default process group already exists; "
            "call torch.distributed.destroy_process_group() first"
        )
    config = read_launch_config(rank, world_size, store is not None)
    timeout = _C.resolve_timeout(timeout)
    backend = backend or os.environ.get("TORCHPAR_BACKEND", "gloo")
    _C.check_backend(backend, config.rank, config.local_rank)
    if config.bind_cores:
        bind_cores(config.local_rank, config.local_world_size)
    if store is None:
        store = _C.connect_store(config, timeout)
    group_store = dist.PrefixStore("torchpar_default/", store)
    _C.wait_for_all_ranks(group_store, config.rank, config.world_size, timeout)
    dist.init_process_group(
        backend=backend, store=group_store, rank=config.rank, world_size=config.world_size, timeout=timeout
    )
    if config.rank == 0:
        logger.info(
            "process group ready: backend %s, %d ranks, restart %d", backend, config.world_size, config.restart_count
        )
    return dist.group.WORLD
