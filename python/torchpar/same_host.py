"""An shm group beside a Gloo group whose ranks share this host, for the data-parallel gradients' traffic."""
from __future__ import annotations

import atexit
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from . import _C

logger = logging.getLogger("torchpar")

_SHM_GROUPS: dict[dist.ProcessGroup, dist.ProcessGroup] = {}
# Let go of them while the interpreter is whole: a group destroy_process_group dropped would otherwise live here
# until finalization, where Gloo's threads dropping tensors can abort the process (pytorch#179291's "terminate
# called without an active exception").
atexit.register(_SHM_GROUPS.clear)


def shm_group_beside(process_group: dist.ProcessGroup, device: torch.device) -> dist.ProcessGroup | None:
    """An "shm" group over ``process_group``'s ranks, in the same order, when ``process_group`` is Gloo with all its
    ranks on this host (CPU tensors only); None otherwise (a group made in C++ included), or when ``TORCHPAR_DDP_SAME_HOST=0``. DDP moves its
    gradient buckets and its parameters' and buffers' broadcasts through it, the pipeline its replicas' gradient
    averages, and the planner measures it: the bulk data goes through shared memory while the control
    collectives stay on Gloo, as the pipeline's rings and the parameter server's shared values do beside Gloo.
    One group per Gloo group, shared by every caller; collective over ``process_group``."""
    if os.environ.get("TORCHPAR_DDP_SAME_HOST", "1") == "0" or device.type != "cpu" or process_group.size() < 2:
        return None
    if process_group not in dist.distributed_c10d._world.pg_map or dist.get_backend(process_group) != "gloo":
        return None  # not Gloo, or made in C++ (ParallelGrid's groups), which has no ranks to name here
    cached = _SHM_GROUPS.get(process_group)
    if cached is not None and cached in dist.distributed_c10d._world.pg_map:
        return cached
    hosts: list[Any] = [None] * process_group.size()
    dist.all_gather_object(hosts, _C.host_key(), group=process_group)
    if len(set(hosts)) != 1:
        return None
    group = _new_group_named_after(process_group)
    _SHM_GROUPS[process_group] = group
    return group


def _new_group_named_after(process_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """An shm group over ``process_group``'s ranks, named after it. Not through ``dist.new_group``: that numbers
    groups by a count every rank keeps, and a group only some ranks make (DDP over a subgroup wraps a model on
    its ranks only) would leave the others' counts behind, so the next group made by every rank would get a
    different name on each and hang in its rendezvous."""
    c10d = dist.distributed_c10d
    ranks = dist.get_process_group_ranks(process_group)
    gloo_name = c10d._get_process_group_name(process_group)
    group, _ = c10d._new_process_group_helper(
        len(ranks), ranks.index(dist.get_rank()), ranks, "shm", c10d._get_default_store(),
        c10d.GroupName(f"torchpar_shm_beside_{gloo_name}"), timeout=_C.group_timeout(process_group),
        group_desc=f"torchpar shm beside {gloo_name}")
    c10d._world.pg_group_ranks[group] = {global_rank: group_rank for group_rank, global_rank in enumerate(ranks)}
    logger.debug("data-parallel traffic goes through a same-host shm group beside Gloo group %s", gloo_name)
    return group
