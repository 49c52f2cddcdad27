"""torchpar's c10d backends, registered with torch.distributed when torchpar is imported."""
import datetime

import torch.distributed as dist

from . import _C


def _create_shm_backend(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
    return _C.make_shm_backend(store, rank, size, timeout)


def register_backends() -> None:
    """Makes ``dist.init_process_group("shm")`` (and "cpu:shm,cuda:nccl") create torchpar's backend."""
    if "shm" not in dist.Backend.backend_list:
        dist.Backend.register_backend("shm", _create_shm_backend, devices=["cpu"])
