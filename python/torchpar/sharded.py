"""Sharded data parallelism (ZeRO stages 1 and 2) on torchpar's C++ engine.

    model = torchpar.ShardedDataParallel(model, stage=2)              # every rank keeps the whole model
    optimizer = torchpar.ShardedOptimizer(model, torch.optim.Adam, lr=1e-3)   # steps this rank's shard only
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()      # gradient buckets reduce-scattered while backward runs
    optimizer.step()                     # the shard stepped, then every rank's shard all-gathered

Stage 1 shards the optimizer state over the group (Adam's two moments take 1/N of their memory); stage 2 also
the averaged gradients: a parameter's ``.grad`` is released once its bucket is reduce-scattered. The bytes moved
per step are DDP's. The parameters themselves stay whole on every rank (stage 3 is not implemented yet).
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from . import _C

__all__ = ["ShardedDataParallel", "ShardedOptimizer"]


class ShardedDataParallel(nn.Module):
    """Data parallelism whose optimizer state (stage 1) and gradients (stage 2) are sharded over ``process_group``.

    Construction is collective: every rank must build the same model; rank 0's parameters and buffers are
    copied to every rank. Parameters listed twice (tied) count once; frozen ones stay replicated and untouched.
    ``mp_policy`` is torch's ``torch.distributed.fsdp.MixedPrecisionPolicy``: the model's floating-point
    parameters are cast to ``param_dtype`` (the shard keeps the master copy in their own dtype), gradients are
    reduced in ``reduce_dtype``, and floating-point inputs are cast when ``cast_forward_inputs``.
    """

    def __init__(self, module: nn.Module, stage: int = 2, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float = 25.0, broadcast_buffers: bool = True, mp_policy: Any = None) -> None:
        super().__init__()
        if process_group is None:
            if not dist.is_initialized():
                raise RuntimeError("ShardedDataParallel: the default process group is not initialized; call "
                                   "torchpar.init_process_group() first")
            process_group = dist.distributed_c10d._get_default_group()
        self.module = module
        self.process_group = process_group
        self.mp_policy = mp_policy
        self._coordinator = _C.sharded.ShardedCoordinator(
            list(module.named_parameters(remove_duplicate=False)), list(module.named_buffers()), process_group,
            stage=stage, bucket_cap_mb=bucket_cap_mb, broadcast_buffers=broadcast_buffers,
            param_dtype=getattr(mp_policy, "param_dtype", None), reduce_dtype=getattr(mp_policy, "reduce_dtype", None))

    @property
    def stage(self) -> int:
        return self._coordinator.stage

    def shard_parameters(self) -> list[torch.Tensor]:
        """This rank's shard of the trained parameters, one flat tensor per dtype: what its optimizer steps."""
        return self._coordinator.shard

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._coordinator.pre_forward(self._coordinator.will_sync())
        policy = self.mp_policy
        if policy is not None and policy.param_dtype is not None and getattr(policy, "cast_forward_inputs", True):
            def cast(value: Any) -> Any:
                return value.to(policy.param_dtype) if torch.is_tensor(value) and value.is_floating_point() else value
            inputs = tuple(cast(value) for value in inputs)
            kwargs = {key: cast(value) for key, value in kwargs.items()}
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next synchronised one reduces the sum."""
        previous = self._coordinator.grad_sync
        self._coordinator.grad_sync = False
        try:
            yield
        finally:
            self._coordinator.grad_sync = previous

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model's averaged gradients (collective): the shards'
        gradients scaled; returns the total norm."""
        return torch.tensor(self._coordinator.clip_grad_norm(float(max_norm), float(norm_type)))

    @property
    def bytes_sent_last_step(self) -> int:
        """Bytes this rank sent in the last step's reduce-scatters and all-gathers (the ring algorithm's count)."""
        return self._coordinator.bytes_sent_last_step


class ShardedOptimizer(torch.optim.Optimizer):
    """Any ``torch.optim`` optimizer over one rank's shard of a :class:`ShardedDataParallel` model; the
    constructor reads as torch's ``ZeroRedundancyOptimizer(params, optimizer_class, **defaults)``.

    ``step()`` steps the shard, then all-gathers every rank's updated shard into the model's parameters;
    ``zero_grad()`` also releases the parameters' own gradients. ``state_dict()`` is this rank's shard's state.
    Works with ``torch.optim.lr_scheduler`` (the param groups are the inner optimizer's).
    """

    def __init__(self, model: ShardedDataParallel, optimizer_class: Callable[..., torch.optim.Optimizer],
                 **defaults: Any) -> None:
        if not isinstance(model, ShardedDataParallel):
            raise TypeError(f"ShardedOptimizer needs a torchpar.ShardedDataParallel model, got {type(model).__name__}")
        self.model = model
        self.optimizer = optimizer_class(model.shard_parameters(), **defaults)
        super().__init__(model.shard_parameters(), self.optimizer.defaults)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = self.optimizer.step(closure)
        self.model._coordinator.gather_parameters()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.model._coordinator.zero_parameter_gradients()

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard's state: loads back only into the same group size (see full_state_dict)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def full_state_dict(self) -> dict[str, Any]:
        """The whole optimizer state, the same on every rank (collective): ``{"state": {parameter name: {key:
        value}}, "param_groups": [...]}``, each per-element state (Adam's moments, momentum buffers) shaped like
        its parameter. ``load_full_state_dict`` loads it on any number of ranks."""
        coordinator = self.model._coordinator
        names = coordinator.parameter_names
        state: dict[str, dict[str, Any]] = {}
        for index, shard in enumerate(coordinator.shard):
            members = coordinator.shard_members(index)
            for key, value in self.optimizer.state.get(shard, {}).items():
                if torch.is_tensor(value) and value.shape == shard.shape:
                    for parameter, whole in coordinator.gather_full(index, value):
                        state.setdefault(names[parameter], {})[key] = whole
                else:  # a per-tensor value, e.g. Adam's step: the same for every parameter of the shard
                    for parameter in members:
                        state.setdefault(names[parameter], {})[key] = copy.deepcopy(value)
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def load_full_state_dict(self, full_state: dict[str, Any]) -> None:
        """What ``full_state_dict`` gave, possibly on another number of ranks: each rank takes its shard of it."""
        coordinator = self.model._coordinator
        names = coordinator.parameter_names
        shapes = {name: parameter.shape for name, parameter in self.model.module.named_parameters()}
        missing = [name for name in names if name not in full_state["state"]]
        if missing and len(missing) != len(names):
            raise ValueError(f"ShardedOptimizer.load_full_state_dict: no state for parameters {missing}")
        for index, shard in enumerate(coordinator.shard):
            members = coordinator.shard_members(index)
            if not members or missing:
                continue
            shard_state: dict[str, Any] = {}
            for key, value in full_state["state"][names[members[0]]].items():
                if torch.is_tensor(value) and value.shape == shapes[names[members[0]]]:
                    whole = [torch.empty(0)] * len(names)
                    for parameter in members:
                        whole[parameter] = full_state["state"][names[parameter]][key]
                    shard_state[key] = coordinator.shard_of(index, whole).to(shard.device)
                else:
                    shard_state[key] = copy.deepcopy(value)
            self.optimizer.state[shard] = shard_state
        for group, saved in zip(self.optimizer.param_groups, full_state["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
