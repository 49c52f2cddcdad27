"""glibc's allocator hands freed memory back to the system, and a training step then faults it back in page by
page: PyTorch's CPU tensors come straight from malloc. A fresh process maps every tensor of 128 KiB and more on
its own and unmaps it when freed, and trims the top of its heap once 128 KiB there is free (both limits rise only
when a large mapped block is freed). On this project's 2-core machine the deep MLP of ``torchpar.plan.examples``
took 1,200-1,800 page faults per forward and backward and 6-9 ms, against none and ~4.5 ms with freed memory
kept; and how fast a step ran depended on what the process had allocated before (docs/planner.md). Keeping freed
blocks in glibc's heap instead (its thresholds raised) costs memory that grows: blocks of other sizes fall between
the freed ones, and the sharded engine's heap reached 2-3x its tensors' peak after 400 steps, still growing.

:func:`keep_freed_memory` makes torchpar's CPU allocator map each tensor block of 128 KiB and more itself and keep
it once freed for the next block of its size, as the CUDA caching allocator does on the GPU: after the first steps
nothing is faulted in and the resident set stops growing at what the allocator reserved
(:func:`cpu_max_memory_reserved`). C++: ``torchpar::keep_freed_memory()``.

LibTorch keeps no count of CPU tensor memory (``torch.cuda.max_memory_allocated`` has no CPU counterpart):
:func:`count_cpu_allocations` installs one around its CPU allocator, and :func:`cpu_memory_allocated`,
:func:`cpu_max_memory_allocated` and :func:`reset_cpu_peak_memory` read it — the allocator's view of what a rank
holds, beside its resident set.
"""
from __future__ import annotations


from . import _C

SMALLEST_KEPT_BLOCK = _C.memory.SMALLEST_KEPT_BLOCK


def keep_freed_memory(most_kept_free: int = 256 << 20) -> None:
    """From now on CPU tensor blocks of ``SMALLEST_KEPT_BLOCK`` bytes and more are kept once freed and reused for
    the next block of their size; once more than `most_kept_free` bytes of blocks are free, the least recently
    freed go back to the system. Also counts allocations (:func:`count_cpu_allocations`). Idempotent; a second
    call only changes `most_kept_free`."""
    _C.memory.keep_freed_memory(most_kept_free)


def keeping_freed_memory() -> bool:
    """Whether :func:`keep_freed_memory` was called in this process."""
    return _C.memory.keeping_freed_memory()


def release_freed_memory() -> None:
    """Every kept free block back to the system (``torch.cuda.empty_cache``'s counterpart)."""
    _C.memory.release_freed_memory()


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


def cpu_memory_reserved() -> int:
    """Bytes of blocks :func:`keep_freed_memory` keeps mapped, in use and free (0 before it was called)."""
    return _C.memory.cpu_allocations()[2]


def cpu_max_memory_reserved() -> int:
    """The most :func:`cpu_memory_reserved` was since :func:`reset_cpu_peak_memory` (or counting began)."""
    return _C.memory.cpu_allocations()[3]


def reset_cpu_peak_memory() -> None:
    """The peaks (allocated and reserved) set to what is allocated and reserved now."""
    _C.memory.reset_cpu_allocation_peak()


class TensorPeak:
    """The most CPU tensor memory this process allocates from its creation on, beyond what it held then: what
    torchpar's planner predicts per rank (``tensor_memory_per_rank``), the data loaded before aside. Starts
    counting allocations (:func:`count_cpu_allocations`) and resets the peak.

        peak = torchpar.allocator.TensorPeak()   # after loading the data
        ...                                      # train
        peak.stop()                              # before scoring the held-out set
        fullest = peak.fullest_rank()            # every rank calls it
    """

    def __init__(self):
        count_cpu_allocations()
        self._held = cpu_memory_allocated()
        self._stopped = None
        reset_cpu_peak_memory()

    def stop(self) -> None:
        """What follows is not counted."""
        self._stopped = self.bytes()

    def bytes(self) -> int:
        return self._stopped if self._stopped is not None else cpu_max_memory_allocated() - self._held

    def fullest_rank(self, group=None) -> int:
        """The largest rank's :meth:`bytes` over `group` (the default group if None); every rank calls it."""
        import torch
        import torch.distributed as dist

        peak = torch.tensor([self.bytes()], dtype=torch.int64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        return int(peak)
