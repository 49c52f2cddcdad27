"""torchpar's c10d backends, registered with torch.distributed when torchpar is imported."""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d

from . import _C


def _create_shm_backend(options, _backend_options):
    backend = _C.make_shm_backend(options.store, options.group_rank, options.group_size, options.timeout)
    torch_group = getattr(options, "process_group", None)  # torch >= 2.12 hands over the group it builds
    if torch_group is None or torch_group._get_backend_name() != "custom":
        # One of several backends of a group torch assembles ("cpu:shm,cuda:nccl"): the default one,
        # whose name the group reports, is the other.
        return backend
    # shm alone: torch takes a process group returned here as the group itself. This one reports
    # "shm" (c10d's says "custom" for any backend outside torch, and DDP's logging repeats it); torch
    # then skips its debug wrapper for the group, so under TORCH_DISTRIBUTED_DEBUG=DETAIL it is applied
    # here, as torch applies it to its own backends.
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:
        backend = distributed_c10d._create_process_group_wrapper(
            wrapped_pg=backend,
            store_prefix=options.group_id,
            store=options.store,
            rank=options.group_rank,
            world_size=options.group_size,
            timeout=options.timeout,
        )
    return _C.named_process_group(options.store, options.group_rank, options.group_size, "shm", backend)


def register_backends() -> None:
    """Makes ``dist.init_process_group("shm")`` (and "cpu:shm,cuda:nccl") create torchpar's backend."""
    if "shm" not in dist.Backend.backend_list:
        dist.Backend.register_backend("shm", _create_shm_backend, extended_api=True, devices=["cpu"])
