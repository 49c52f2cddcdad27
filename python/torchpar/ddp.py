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
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from . import _C
from .grad_sync import sync_disabled, tensors_in
from .same_host import shm_group_beside

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


def _resolve_process_group(process_group: dist.ProcessGroup | None, device_mesh: Any) -> dist.ProcessGroup:
    """torch's rules: a process group, or a one-dimensional device mesh, or the default group."""
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        return device_mesh.get_group(mesh_dim=0)
    if process_group is not None:
        return process_group
    if not dist.is_initialized():
        raise RuntimeError(
            "DistributedDataParallel: the default process group is not initialized; call "
            "torchpar.init_process_group() first"
        )
    return dist.distributed_c10d._get_default_group()


class _DDPJoinHook(JoinHook):
    """On a rank that ran out of inputs inside a Join context: each main_hook mirrors one iteration of the
    ranks still training (buffer broadcast, gradient all-reduces with zeros); post_hook gives every rank
    the model of the rank that trained longest."""

    def __init__(self, ddp: "DistributedDataParallel", divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        self.ddp._coordinator.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._coordinator.synchronise_final_model()


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """Data parallelism over a process group: each rank holds a replica of ``module``; backward
    averages gradients across ranks in buckets whose all-reduce overlaps the rest of backward.

    A subclass of torch's ``DistributedDataParallel`` with torchpar's engine behind it (torch's
    constructor is never run, so no torch Reducer exists): every ``isinstance`` check of another
    library, torch.distributed.checkpoint's ``get_model_state_dict``/``set_model_state_dict`` (bare keys)
    and Lightning's unwrapping treat it as torch's. torch methods that only make sense on torch's
    Reducer raise ``NotImplementedError`` naming themselves.

    The signature is torch's (torch 2.15), argument for argument, so positional calls land on the same
    parameters. ``device_ids`` may name at most one device (one replica per process); ``output_device``
    and ``dim`` are kept as attributes and have no effect, as in torch's DDP for single-device modules.
    ``batched_grad_copy``, ``lazy_bucket_allocation`` and ``skip_all_reduce_unused_params`` are torch's
    speed and memory options: accepted, with the same results, without their saving (unused parameters'
    zero gradients are still all-reduced). ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``
    and ``mixed_precision`` are refused with an error.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: list[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        lazy_bucket_allocation: bool = False,
    ) -> None:
        # torch's __init__ would build its own Reducer: only the bases' constructors run.
        nn.Module.__init__(self)
        Joinable.__init__(self)
        for name, value in (
            ("delay_all_reduce_named_params", delay_all_reduce_named_params),
            ("param_to_hook_all_reduce", param_to_hook_all_reduce),
            ("mixed_precision", mixed_precision),
        ):
            if value is not None:
                raise NotImplementedError(
                    f"torchpar.DistributedDataParallel does not implement {name}; leave it None (for lower "
                    "precision use torch.autocast around the forward, or torch's DistributedDataParallel)"
                )
        self.process_group = _resolve_process_group(process_group, device_mesh)
        self.device_mesh = device_mesh
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named_parameters = [(n, p) for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        if not any(p.requires_grad for _, p in named_parameters):
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a "
                "gradient."
            )
        if any(isinstance(p, nn.parameter.UninitializedParameter) for _, p in named_parameters):
            raise RuntimeError(
                "Modules with uninitialized parameters can't be used with `DistributedDataParallel`. Run a dummy "
                "forward pass to correctly initialize the modules"
            )
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(f"DistributedDataParallel: one device per process, got device_ids={device_ids}")
        device_types = {p.device.type for _, p in named_parameters}
        if len(device_types) != 1:
            raise ValueError(
                "DistributedDataParallel's input module must be on the same type of devices, but input module "
                f"parameters locate in {device_types}."
            )
        self.device = named_parameters[0][1].device
        if self.device.type == "cpu" or not device_ids:
            if device_ids or output_device is not None:
                raise ValueError(
                    "DistributedDataParallel device_ids and output_device arguments only work with single-device "
                    f"GPU modules, but got device_ids {device_ids}, output_device {output_device}, and module "
                    f"parameters on {self.device}."
                )
            self.device_ids = None
            self.output_device = None
        else:
            self.device_ids = [torch.device(d).index if not isinstance(d, int) else d for d in device_ids]
            self.output_device = self.device_ids[0] if output_device is None else output_device
        if check_reduction:
            warnings.warn(
                "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please avoid "
                "using it.",
                FutureWarning,
                stacklevel=2,
            )
        # torch's rule: the deprecated broadcast_buffers=False also skips the buffers' copy at construction;
        # forward_sync_buffers governs the forwards only.
        if forward_sync_buffers is not None:
            self.forward_sync_buffers = forward_sync_buffers
            init_sync_buffers = True
        else:
            self.forward_sync_buffers = True if broadcast_buffers is None else broadcast_buffers
            init_sync_buffers = self.forward_sync_buffers
        self.module = module
        self.dim = dim
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.lazy_bucket_allocation = lazy_bucket_allocation
        if bucket_cap_mb_list:
            self.bucket_cap_mb = float(max(bucket_cap_mb_list))
        else:
            self.bucket_cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        # As torch: the small first bucket applies only when the caller left the bucket sizes unset.
        self._first_bucket_cap_mb = (
            DEFAULT_FIRST_BUCKET_CAP_MB if bucket_cap_mb is None and not bucket_cap_mb_list else self.bucket_cap_mb
        )
        self.bucket_cap_mb_list = list(bucket_cap_mb_list or [])
        self._divide_by_initial_world_size = True
        self._data_group = shm_group_beside(self.process_group, self.device)
        self._coordinator = self._build_coordinator(init_sync=init_sync, init_sync_buffers=init_sync_buffers)
        if self._coordinator.timeline_path:
            logger.info("writing the DDP timeline to %s", self._coordinator.timeline_path)

    def _build_coordinator(self, init_sync: bool, init_sync_buffers: bool) -> Any:
        ignored = self.parameters_to_ignore
        return _C.ddp.ReplicaCoordinator(
            [(n, p) for n, p in self.module.named_parameters() if n not in ignored],
            [(n, b) for n, b in self.module.named_buffers() if n not in ignored],
            self.process_group,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_cap_mb=self._first_bucket_cap_mb,
            bucket_cap_mb_list=self.bucket_cap_mb_list,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            broadcast_buffers=self.forward_sync_buffers,
            static_graph=self.static_graph,
            init_sync=init_sync,
            init_sync_buffers=init_sync_buffers,
            data_process_group=self._data_group,
        )

    @property
    def broadcast_buffers(self) -> bool:
        """torch's deprecated name of ``forward_sync_buffers``."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    @property
    def require_manual_backward_finalization(self) -> bool:
        """torchpar finalises every backward itself (torch's default)."""
        return False

    @require_manual_backward_finalization.setter
    def require_manual_backward_finalization(self, required: bool) -> None:
        if required:
            raise NotImplementedError(
                "torchpar.DistributedDataParallel does not implement manual backward finalization; its reducer "
                "finalises each backward itself"
            )

    @property
    def should_finalize_after_backward(self) -> bool:
        return False

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: list[str]) -> None:
        """torch's hook for leaving parameters and buffers (by fully qualified name) out of DDP: they are
        neither synchronised at construction nor reduced."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore

    def __getstate__(self) -> dict[str, Any]:
        """As torch: a wrapped model pickles (``torch.save``, ``copy.deepcopy``) without its process group,
        which is the default group again when it is loaded."""
        if self.process_group is not dist.distributed_c10d._get_default_group():
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process group. That "
                "is, when you have called init_process_group and have not passed process_group argument to DDP "
                "constructor"
            )
        state = dict(self.__dict__)
        del state["process_group"], state["_coordinator"], state["_data_group"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)
        self.process_group = dist.distributed_c10d._get_default_group()
        # No collective here: a copy is made on one rank alone, and its replica is already complete.
        self._data_group = None
        self._coordinator = self._build_coordinator(init_sync=False, init_sync_buffers=False)

    def _set_static_graph(self) -> None:
        """torch's way to declare a static graph after construction, before the first iteration."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self._coordinator.set_static_graph()
        self.static_graph = True

    # Joinable: torch's generic Join context manager (torch.distributed.algorithms.join.Join).
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that shadows this model's collectives on a rank that ran out of inputs. Keyword:
        ``divide_by_initial_world_size`` (default True; False divides by the ranks still training)."""
        return _DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    @property
    def require_backward_grad_sync(self) -> bool:
        return self._coordinator.grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, enabled: bool) -> None:
        self._coordinator.grad_sync = enabled

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        joining = self._join_config.enable
        if joining:
            Join.notify_join_context(self)  # the Join context's own count of ranks still training
        if joining != self._coordinator.joining:
            # Entering a Join context, or leaving one that ended with an exception.
            if joining:
                self._coordinator.begin_join(self._divide_by_initial_world_size)
            else:
                self._coordinator.cancel_join()
        will_sync = torch.is_grad_enabled() and self._coordinator.grad_sync
        self._coordinator.pre_forward(will_sync)
        output = self.module(*inputs, **kwargs)
        self._coordinator.post_forward(tensors_in(output) if will_sync else [], will_sync)
        return output

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate gradients locally; the next synchronised one averages the sum."""
        return sync_disabled(self._coordinator)

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """Uneven inputs (torch's ``join``): ranks whose loop ends early shadow the others' collectives
        until every rank is done; then all ranks hold the model of the rank that trained longest. With
        ``throw_on_early_termination`` every rank raises as soon as one runs out of inputs instead."""
        return Join(
            [self], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size
        )

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

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """The part of torch's DDP logging data torchpar knows (Lightning reads it at teardown)."""
        return {
            "module_name": type(self.module).__name__,
            "world_size": self.process_group.size(),
            "backend_name": self.process_group.name(),
            "bucket_cap_bytes": int(self.bucket_cap_mb * 1024 * 1024),
            "find_unused_parameters": self.find_unused_parameters,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "static_graph": self.static_graph,
            "can_set_static_graph": False,
        }

    def bucket_indices(self) -> list[list[int]]:
        """The gradient buckets in all-reduce order, as indices into ``module.parameters()`` that require grad."""
        return self._coordinator.bucket_indices()


# torch's methods that need no Reducer of torch's: inherited as they are.
_INHERITED_FROM_TORCH = {
    "_get_active_ddp_module",
    "_inside_ddp_forward",
    "_get_data_parallel_params",
    "_distributed_rank",
    "_log_and_throw",
    "scatter",
    "to_kwargs",
    "gather",
    "train",
}


def _refusal(name: str) -> Any:
    def refuse(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"torchpar.DistributedDataParallel does not implement {name} of torch's DistributedDataParallel (it "
            "works on torch's Reducer, which torchpar's engine replaces); use torch's DistributedDataParallel "
            "where you need it"
        )

    refuse.__name__ = name
    return refuse


# Every other torch method would reach for attributes torch's constructor makes (self.reducer, ...) and fail
# with an AttributeError that names neither the method nor the reason.
for _name, _value in vars(torch.nn.parallel.DistributedDataParallel).items():
    if _name.startswith("__") or _name in vars(DistributedDataParallel) or _name in _INHERITED_FROM_TORCH:
        continue
    if callable(_value) or isinstance(_value, (property, staticmethod, classmethod)):
        setattr(DistributedDataParallel, _name, _refusal(_name))
