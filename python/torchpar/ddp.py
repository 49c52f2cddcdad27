"""DistributedDataParallel on torchpar's C++ reducer, with torch's constructor and state_dict keys.

A script switches from torch's DDP by changing the import::

    model = torchpar.DistributedDataParallel(model)          # was torch.nn.parallel.DistributedDataParallel
    with model.no_sync(): ...                                 # same context managers
    model.register_comm_hook(None, torchpar.ddp.fp16_compress_hook)

Communication hooks: ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook`` and
``powerSGD_hook`` (with a :class:`PowerSGDState`) run in C++; any Python callable
``hook(state, bucket) -> torch.futures.Future`` works too, torch's own hooks included.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from . import _C

logger = logging.getLogger("torchpar.ddp")

__all__ = [
    "DistributedDataParallel",
    "PowerSGDState",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "powerSGD_hook",
]

DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0


@dataclasses.dataclass(frozen=True)
class BuiltinCommHook:
    """A communication hook implemented in C++: pass it to ``register_comm_hook``."""

    name: str

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future:
        raise TypeError(f"torchpar.ddp.{self.name} runs inside the C++ reducer; pass it to register_comm_hook")


allreduce_hook = BuiltinCommHook("allreduce_hook")
fp16_compress_hook = BuiltinCommHook("fp16_compress_hook")
bf16_compress_hook = BuiltinCommHook("bf16_compress_hook")
powerSGD_hook = BuiltinCommHook("powerSGD_hook")

_CPP_HOOK_NAMES = {allreduce_hook: "allreduce", fp16_compress_hook: "fp16", bf16_compress_hook: "bf16"}


@dataclasses.dataclass
class PowerSGDState:
    """State of ``powerSGD_hook``; the names and defaults are torch's ``PowerSGDState``'s."""

    process_group: dist.ProcessGroup | None = None
    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1_000
    min_compression_rate: float = 2
    use_error_feedback: bool = True
    warm_start: bool = True
    random_seed: int = 0


def _find_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a forward's output (nested tuples, lists, dicts, dataclasses)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _find_tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _find_tensors(item)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for field in dataclasses.fields(value) for t in _find_tensors(getattr(value, field.name))]
    return []


class DistributedDataParallel(nn.Module):
    """Data parallelism over a process group: each rank holds a replica of ``module``; backward
    averages gradients across ranks in buckets whose all-reduce overlaps the rest of backward.

    The arguments are torch's. ``device_ids`` may name at most one device (one replica per process);
    ``output_device`` and ``dim`` are accepted for compatibility and ignored, as they are in torch's DDP
    for single-device modules.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(f"DistributedDataParallel: one device per process, got device_ids={device_ids}")
        if process_group is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "DistributedDataParallel: the default process group is not initialized; "
                    "call torchpar.init_process_group() first"
                )
            process_group = dist.distributed_c10d._get_default_group()
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.bucket_cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self._coordinator = _C.ddp.ReplicaCoordinator(
            list(module.named_parameters()),
            list(module.named_buffers()),
            process_group,
            bucket_cap_mb=self.bucket_cap_mb,
            # As torch: the small first bucket applies only when the caller left bucket_cap_mb unset.
            first_bucket_cap_mb=DEFAULT_FIRST_BUCKET_CAP_MB if bucket_cap_mb is None else self.bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=broadcast_buffers,
            static_graph=static_graph,
        )
        if self._coordinator.timeline_path:
            logger.info("writing the DDP timeline to %s", self._coordinator.timeline_path)

    @property
    def require_backward_grad_sync(self) -> bool:
        return self._coordinator.grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, enabled: bool) -> None:
        self._coordinator.grad_sync = enabled

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        will_sync = torch.is_grad_enabled() and self._coordinator.grad_sync
        self._coordinator.pre_forward(will_sync)
        output = self.module(*inputs, **kwargs)
        self._coordinator.post_forward(_find_tensors(output) if will_sync else [], will_sync)
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next synchronised one averages the sum."""
        previous = self._coordinator.grad_sync
        self._coordinator.grad_sync = False
        try:
            yield
        finally:
            self._coordinator.grad_sync = previous

    @contextlib.contextmanager
    def join(self, enable: bool = True) -> Iterator[None]:
        """Uneven inputs: ranks whose loop ends early shadow the others' collectives until every rank is
        done; then all ranks hold the model of the rank that trained longest."""
        if not enable:
            yield
            return
        self._coordinator.begin_join()
        try:
            yield
        except BaseException:
            self._coordinator.cancel_join()  # no shadowing after an error: the others time out instead
            raise
        self._coordinator.finish_join()

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """torch's ``register_comm_hook``: ``hook(state, bucket)`` returns a future of the averaged bucket.
        torchpar's built-in hooks run in C++ (``state`` is a process group or None, or a PowerSGDState)."""
        if hook is powerSGD_hook:
            if not isinstance(state, PowerSGDState):
                raise TypeError("powerSGD_hook needs a torchpar.ddp.PowerSGDState as its state")
            self._coordinator.register_powersgd_hook(
                state.process_group,
                state.matrix_approximation_rank,
                state.start_powerSGD_iter,
                float(state.min_compression_rate),
                state.use_error_feedback,
                state.warm_start,
                state.random_seed,
            )
        elif isinstance(hook, BuiltinCommHook):
            self._coordinator.register_builtin_comm_hook(_CPP_HOOK_NAMES[hook], state)
        else:
            self._coordinator.register_comm_hook(state, hook)

    def bucket_indices(self) -> list[list[int]]:
        """The gradient buckets in all-reduce order, as indices into ``module.parameters()`` that require grad."""
        return self._coordinator.bucket_indices()
