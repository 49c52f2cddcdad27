"""glibc's allocator hands freed memory back to the system, and a training step then faults it back in page by
page: PyTorch's CPU tensors come straight from malloc. A fresh process maps every tensor of 128 KiB and more on
its own and unmaps it when freed, and trims the top of its heap once 128 KiB there is free (both limits rise only
when a large mapped block is freed). On this project's 2-core machine the deep MLP of ``torchpar.plan.examples``
took 1,200-1,800 page faults per forward and backward and 6-9 ms, against none and ~4.5 ms with freed memory
kept; and how fast a step ran depended on what the process had allocated before (docs/planner.md).

:func:`keep_freed_memory` fixes both limits, as ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` would
at launch (C++ programs: set those two variables). The cost: up to ``trim_threshold`` bytes of freed memory stay
resident.

LibTorch keeps no count of CPU tensor memory (``torch.cuda.max_memory_allocated`` has no CPU counterpart):
:func:`count_cpu_allocations` installs one around its CPU allocator, and :func:`cpu_memory_allocated`,
:func:`cpu_max_memory_allocated` and :func:`reset_cpu_peak_memory` read it — the allocator's view of what a rank
holds, beside its resident set.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

from . import _C

logger = logging.getLogger("torchpar.allocator")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
LARGEST_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit systems (4 MiB * sizeof(long))


def keep_freed_memory(mmap_threshold: int = LARGEST_MMAP_THRESHOLD, trim_threshold: int = 256 << 20) -> bool:
    """Blocks under `mmap_threshold` come from the heap and up to `trim_threshold` free bytes at its top stay
    there. Returns whether glibc took both; False (and nothing changed) elsewhere, or where the process was
    launched with either variable set, which then wins."""
    if platform.libc_ver()[0] != "glibc":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    taken = bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(min(mmap_threshold, LARGEST_MMAP_THRESHOLD))))
    taken = bool(libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(trim_threshold))) and taken
    if not taken:
        logger.warning("glibc refused the allocator limits (mmap %d, trim %d bytes)", mmap_threshold, trim_threshold)
    return taken


def count_cpu_allocations() -> None:
    """From now on, CPU tensor allocations are counted (tensors allocated before are not). Idempotent."""
    _C.memory.count_cpu_allocations()


def counting_cpu_allocations() -> bool:
    """Whether :func:`count_cpu_allocations` was called in this process."""
    return _C.memory.counting_cpu_allocations()


def cpu_memory_allocated() -> int:
    """Bytes of CPU tensor memory allocated since :func:`count_cpu_allocations` and not yet freed."""
    return _C.memory.cpu_allocations()[0]


def cpu_max_memory_allocated() -> int:
    """The most :func:`cpu_memory_allocated` was since counting began or :func:`reset_cpu_peak_memory`."""
    return _C.memory.cpu_allocations()[1]


def reset_cpu_peak_memory() -> None:
    """The peak set to what is allocated now."""
    _C.memory.reset_cpu_allocation_peak()
