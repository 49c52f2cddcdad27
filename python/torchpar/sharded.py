"""Sharded data parallelism (ZeRO stages 1 and 2) on torchpar's C++ engine.

    model = torchpar.ShardedDataParallel(model, stage=2)              # every rank keeps the whole model
    optimizer = torchpar.ShardedOptimizer(model, torch.optim.Adam, lr=1e-3)   # steps this rank's shard only
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()      # gradient buckets reduce-scattered while backward runs
    optimizer.step()                     # the shard stepped, then every rank's shard all-gathered

Stage 1 shards the optimizer state over the group (Adam's two moments take 1/N of their memory); stage 2 also
the averaged gradients: a parameter's ``.grad`` is released once its bucket is reduce-scattered. The bytes moved
per step are DDP's. Stage 3 also shards the parameters: each unit (a submodule, FSDP2's ``fully_shard`` unit) is
all-gathered just before its forward and its backward and freed after (1.5x DDP's bytes).

    model = torchpar.ShardedDataParallel(model, stage=3, units=[block for block in model.blocks])
"""
from __future__ import annotations

import contextlib
import copy
import types
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import _C
from .grad_sync import sync_disabled, tensors_in
from .same_host import shm_group_beside
from .sharded_dcp import checkpointable_piece, piece_of

__all__ = ["ShardedDataParallel", "ShardedOptimizer"]


class ShardedDataParallel(nn.Module):
    """Data parallelism whose optimizer state (stage 1) and gradients (stage 2) are sharded over ``process_group``.

    Construction is collective: every rank must build the same model; rank 0's parameters and buffers are
    copied to every rank. Parameters listed twice (tied) count once; frozen ones stay replicated and untouched.
    ``mp_policy`` is torch's ``torch.distributed.fsdp.MixedPrecisionPolicy``: the model's floating-point
    parameters are cast to ``param_dtype`` (the shard keeps the master copy in their own dtype), gradients are
    reduced in ``reduce_dtype``, and floating-point inputs are cast when ``cast_forward_inputs``.
    At stage 3, ``prefetch`` starts the next unit's all-gather (the next in forward, the previous in backward) as
    soon as the current one's is done, so it moves while this unit computes; one more unit is gathered at a time.
    Left None it is on for CUDA parameters and off for CPU ones (3-5% faster here, for a unit more at peak).
    """

    def __init__(self, module: nn.Module, stage: int = 2, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float = 25.0, broadcast_buffers: bool = True, mp_policy: Any = None,
                 units: Sequence[str | nn.Module] | type | None = None, reshard_after_forward: bool = True,
                 prefetch: bool | None = None) -> None:
        super().__init__()
        if process_group is None:
            if not dist.is_initialized():
                raise RuntimeError("ShardedDataParallel: the default process group is not initialized; call "
                                   "torchpar.init_process_group() first")
            process_group = dist.distributed_c10d._get_default_group()
        self.module = module
        self.process_group = process_group
        self.mp_policy = mp_policy
        unit_names = _unit_names(module, units) if stage == 3 else []
        if units is not None and stage != 3:
            raise ValueError(f"ShardedDataParallel: units are stage 3's; stage {stage} keeps the parameters whole")
        # As DDP: on a Gloo group whose ranks share this host, the reduce-scatters and all-gathers go through
        # shared memory (Gloo's reduce-scatter costs several all-reduces of the same bytes).
        device = next(module.parameters(), torch.empty(0)).device
        data_group = shm_group_beside(process_group, device) or process_group
        self._coordinator = _C.sharded.ShardedCoordinator(
            list(module.named_parameters(remove_duplicate=False)), list(module.named_buffers()), data_group,
            stage=stage, bucket_cap_mb=bucket_cap_mb, broadcast_buffers=broadcast_buffers,
            param_dtype=getattr(mp_policy, "param_dtype", None), reduce_dtype=getattr(mp_policy, "reduce_dtype", None),
            units=unit_names, reshard_after_forward=reshard_after_forward, prefetch=prefetch)
        self.unit_names = unit_names
        for unit, name in enumerate(unit_names, start=1):
            _gather_around(module.get_submodule(name), self._coordinator, unit)
        if stage == 3:
            _guard_reads(module, self._coordinator, process_group.rank())
        # A state dict loaded into the model (through this wrapper, the module, or torch.distributed.checkpoint)
        # must reach the shards, which the optimizer steps and the next gather spreads.
        module.register_load_state_dict_pre_hook(_weakly(self._before_load))
        module.register_load_state_dict_post_hook(_weakly(self._after_load))

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

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate gradients locally; the next synchronised one reduces the sum."""
        return sync_disabled(self._coordinator)

    def reduce_gradients(self) -> None:
        """Stages 1-2: the gradients that backward passes run outside this wrapper's forward accumulated in the
        module's parameters (a pipeline stage's micro-batches, say) reduce-scattered into the shards now, as a
        synchronised backward does while it runs; then ``optimizer.step()``. Collective over the group."""
        self._coordinator.reduce_gradients()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model's averaged gradients (collective): the shards'
        gradients scaled; returns the total norm."""
        return torch.tensor(self._coordinator.clip_grad_norm(float(max_norm), float(norm_type)))

    def unshard(self) -> None:
        """Stage 3: every unit's parameters gathered (collective), to read them whole outside a forward or
        backward, as FSDP2's ``FSDPModule.unshard``; ``reshard()`` frees them again. Between steps a stage-3
        parameter views no memory, and reading it without this is undefined (as FSDP1's freed storage).
        Stages 1 and 2 hold the whole parameters anyway: nothing to do."""
        if self.stage == 3:
            self._coordinator.gather_all()

    def reshard(self) -> None:
        """Stage 3: every unit's gathered parameters freed again (the rank keeps its shard)."""
        if self.stage == 3:
            self._coordinator.release_all()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """As ``nn.Module.state_dict`` (keys ``module.…``, as DDP's); at stage 3 every unit is gathered for it (a
        collective) and the values are copies."""
        if self.stage != 3:
            return super().state_dict(*args, **kwargs)
        self.unshard()
        try:
            return {key: value.clone() for key, value in super().state_dict(*args, **kwargs).items()}
        finally:
            self.reshard()

    def _before_load(self, module: nn.Module, state_dict: Any, prefix: str, local_metadata: dict, *_: Any) -> None:
        if local_metadata.get("assign_to_params_buffers"):
            raise ValueError("ShardedDataParallel: load_state_dict(assign=True) would replace the parameters it "
                             "shards; load without assign (the values are copied into them)")
        self.unshard()  # stage 3: collective, as loading is done on every rank

    def _after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        coordinator = self._coordinator
        with torch.no_grad():
            values = [module.get_parameter(name).detach() for name in coordinator.parameter_names]
            for index, shard in enumerate(coordinator.shard):
                shard.copy_(coordinator.shard_of(index, values))
        self.reshard()

    def sharded_state_dict(self) -> dict[str, Any]:
        """The module's state dict (its own keys, as ``model.module.state_dict()``'s) for
        ``torch.distributed.checkpoint``, each trained parameter as this rank's piece of its master value (the shard:
        fp32 under a mixed-precision policy), which DCP saves as that part of the whole parameter; buffers and frozen
        parameters whole. Local: nothing is gathered. The checkpoint holds what a bare model's ``state_dict()``
        holds, so any number of ranks, FSDP2 or one process loads it. To resume: ``dcp.load`` into this dict, then
        ``load_sharded_state_dict`` of it."""
        pieces = self._pieces()
        state: dict[str, Any] = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            index = self._trained_index.get(id(value))
            if index is None:
                state[name] = value.detach()
            elif index in pieces:  # a parameter this rank holds no piece of is left to the ranks that do
                shard, start, offset, numel = pieces[index]
                state[name] = checkpointable_piece(self._coordinator.shard[shard].detach()[offset:offset + numel],
                                                   value.shape, start)
        return state

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """What ``sharded_state_dict`` gave, once ``torch.distributed.checkpoint.load`` filled it (possibly from a
        checkpoint of another number of ranks, FSDP2's, or a bare model's): the pieces into the shard, buffers and
        frozen parameters into the module. Collective: stages 1-2 all-gather the parameters."""
        pieces = self._pieces()
        coordinator = self._coordinator
        with torch.no_grad():
            for name, value in self.module.state_dict(keep_vars=True).items():
                if name not in state_dict:
                    continue
                index = self._trained_index.get(id(value))
                if index is None:
                    value.copy_(state_dict[name])
                elif index in pieces:
                    shard, _, offset, numel = pieces[index]
                    coordinator.shard[shard][offset:offset + numel] = piece_of(state_dict[name])
            if self.stage != 3:
                coordinator.gather_parameters()

    @property
    def _trained_index(self) -> dict[int, int]:
        """The trained parameters, every name of a tied one included, by object: their index in the shards' layout."""
        names = self._coordinator.parameter_names
        return {id(self.module.get_parameter(name)): index for index, name in enumerate(names)}

    def _pieces(self) -> dict[int, tuple[int, int, int, int]]:
        """This rank's piece of each trained parameter it holds one of (a parameter lies in one bucket, so at most
        one): parameter index -> (shard, first element in the flattened parameter, offset in the shard, elements)."""
        return {parameter: (shard, start, offset, numel)
                for shard in range(len(self._coordinator.shard))
                for parameter, start, offset, numel in self._coordinator.shard_pieces(shard)}

    @property
    def bytes_sent_last_step(self) -> int:
        """Bytes this rank sent in the last step's reduce-scatters and all-gathers (the ring algorithm's count)."""
        return self._coordinator.bytes_sent_last_step


def _unit_names(module: nn.Module, units: Sequence[str | nn.Module] | type | None) -> list[str]:
    """Stage 3's units as module names, in forward (registration) order: given by name or module, every
    outermost submodule of a type, or by default each direct child holding a trained parameter no other child
    holds."""
    names = {id(m): name for name, m in module.named_modules()}
    if units is None:  # the children holding a trained parameter no other child holds (a tie's copies: the root)
        holders: dict[int, int] = {}
        for _, child in module.named_children():
            for parameter in child.parameters():
                holders[id(parameter)] = holders.get(id(parameter), 0) + 1
        return [name for name, child in module.named_children()
                if any(p.requires_grad and holders[id(p)] == 1 for p in child.parameters())]
    if isinstance(units, type):
        chosen = [name for name, m in module.named_modules() if isinstance(m, units) and name]
        return [name for name in chosen if not any(name.startswith(outer + ".") for outer in chosen)]
    result = []
    for unit in units:
        if isinstance(unit, nn.Module):
            if id(unit) not in names or not names[id(unit)]:
                raise ValueError(f"ShardedDataParallel: unit {type(unit).__name__} is not a submodule of the model")
            result.append(names[id(unit)])
        else:
            try:
                module.get_submodule(unit)
            except AttributeError:
                raise ValueError(f"ShardedDataParallel: the model has no submodule '{unit}' to make a unit") from None
            result.append(unit)
    return result


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` of an object that the caller does not keep alive. The module's hooks hold it: a bound method of the
    wrapper there is a cycle (wrapper -> module -> hook -> wrapper) that keeps the wrapper, its process group and the
    group's worker threads alive past ``del model`` and ``destroy_process_group`` until a garbage collection, or until
    the interpreter is finalizing, when a Gloo worker dropping a Python-owned tensor aborts the process."""
    method_ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = method_ref()
        return None if bound is None else bound(*args, **kwargs)
    return call


def _gather_around(unit_module: nn.Module, coordinator: Any, unit: int) -> None:
    """Stage 3: the unit's parameters gathered before its forward and released after it, gathered again when the
    gradient of its first output arrives (before its backward runs)."""
    def before_backward(grad: torch.Tensor) -> None:
        coordinator.before_unit_backward(unit)

    def before_forward(_module: nn.Module, _inputs: Any) -> None:
        coordinator.before_unit_forward(unit)

    def after_forward(_module: nn.Module, _inputs: Any, output: Any) -> None:
        coordinator.after_unit_forward(unit)
        for tensor in tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(before_backward)

    unit_module.register_forward_pre_hook(before_forward)
    unit_module.register_forward_hook(after_forward)


# What may be asked of a stage-3 parameter whose storage is released: its metadata, its gradient, its hooks.
_READS_NO_VALUES = frozenset([
    torch.Tensor.device.__get__, torch.Tensor.dtype.__get__, torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__,
    torch.Tensor.layout.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor.is_sparse.__get__, torch.Tensor.is_quantized.__get__, torch.Tensor.requires_grad.__get__,
    torch.Tensor.requires_grad.__set__, torch.Tensor.is_leaf.__get__, torch.Tensor.grad.__get__,
    torch.Tensor.grad.__set__, torch.Tensor.grad.__delete__, torch.Tensor.grad_fn.__get__,
    torch.Tensor._backward_hooks.__get__, torch.Tensor._backward_hooks.__set__, torch.Tensor._post_accumulate_grad_hooks.__get__,
    torch.Tensor._post_accumulate_grad_hooks.__set__, torch.Tensor.retains_grad.__get__, torch.Tensor.size,
    torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.stride, torch.Tensor.element_size,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.is_contiguous, torch.Tensor.get_device,
    torch.Tensor.requires_grad_, torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
    torch.Tensor.untyped_storage, torch.Tensor.data_ptr, torch.Tensor.storage_offset, torch.Tensor.__hash__,
])


class _ShardedParameter(nn.Parameter):
    """A stage-3 parameter. Between its unit's gathers it views no memory, and a kernel reading it would read
    through a null pointer: such a read is refused instead, naming the parameter, its unit and the rank."""

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _READS_NO_VALUES:
            for value in (*args, *kwargs.values()):
                for tensor in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(tensor, _ShardedParameter):
                        tensor._refuse_if_released(func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _refuse_if_released(self, func: Callable) -> None:
        where = self.__dict__.get("_torchpar_sharded")  # a copy (deepcopy of a gathered one) is a plain value
        if where is None:
            return
        coordinator, index, name, unit, rank = where
        if not coordinator.parameter_gathered(index):
            attribute = getattr(func, "__self__", None)  # a property's getter: name the property
            what = attribute.__name__ if isinstance(attribute, types.GetSetDescriptorType) else func.__name__
            raise RuntimeError(
                f"ShardedDataParallel (stage 3): parameter '{name}' ({unit}) read ({what}) on rank {rank} outside "
                "its unit's forward and backward, where a rank holds only its shard and the parameter views no "
                "memory. Call unshard() on the ShardedDataParallel model before reading it (reshard() after), or read "
                "the ShardedDataParallel model's state_dict().")


def _guard_reads(module: nn.Module, coordinator: Any, rank: int) -> None:
    """Stage 3: each trained parameter becomes a _ShardedParameter (same object, so autograd, the coordinator's
    hooks and the user's references still hold it) that knows its index and its unit."""
    for index, name in enumerate(coordinator.parameter_names):
        parameter = module.get_parameter(name)
        parameter.__class__ = _ShardedParameter
        parameter.__dict__["_torchpar_sharded"] = (coordinator, index, name, coordinator.unit_of(index), rank)


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

    def sharded_state_dict(self) -> dict[str, Any]:
        """For ``torch.distributed.checkpoint``: ``full_state_dict``'s form (state keyed by parameter name, which
        ``param_groups`` list as FSDP2's do), each per-element state being this rank's piece of it, which DCP saves as
        that part of a tensor shaped like the parameter. Local: nothing is gathered. A fresh optimizer's state is made
        first (a step of learning rate 0 on zero gradients), so that a load has somewhere to go. To resume:
        ``dcp.load`` into this dict, then ``load_sharded_state_dict`` of it."""
        self._make_state()
        model = self.model
        names = model._coordinator.parameter_names
        shapes = {name: parameter.shape for name, parameter in model.module.named_parameters()}
        pieces = model._pieces()
        state: dict[str, dict[str, Any]] = {}
        for parameter, (shard_index, start, offset, numel) in pieces.items():
            shard = model._coordinator.shard[shard_index]
            entry = state.setdefault(names[parameter], {})
            for key, value in self.optimizer.state[shard].items():
                if torch.is_tensor(value) and value.shape == shard.shape:
                    entry[key] = checkpointable_piece(value[offset:offset + numel], shapes[names[parameter]], start)
                else:  # a per-tensor value, e.g. Adam's step: the same for every parameter of the shard
                    entry[key] = value
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(names)}
                  for group in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """What ``sharded_state_dict`` gave, once ``torch.distributed.checkpoint.load`` filled it (possibly from a
        checkpoint of another number of ranks, or FSDP2's): each piece into this rank's shard of the state."""
        model = self.model
        names = model._coordinator.parameter_names
        for parameter, (shard_index, _, offset, numel) in model._pieces().items():
            shard = model._coordinator.shard[shard_index]
            saved = state_dict["state"].get(names[parameter])
            if saved is None:
                raise ValueError(f"ShardedOptimizer.load_sharded_state_dict: no state for parameter {names[parameter]}")
            shard_state = self.optimizer.state[shard]
            for key, value in saved.items():
                if torch.is_tensor(shard_state.get(key)) and shard_state[key].shape == shard.shape:
                    shard_state[key][offset:offset + numel] = piece_of(value)
                else:
                    shard_state[key] = copy.deepcopy(value)
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _make_state(self) -> None:
        """Each shard's optimizer state made where it is missing, by a step of learning rate 0 on zero gradients."""
        shards = self.model._coordinator.shard
        missing = [shard for shard in shards if not self.optimizer.state.get(shard)]
        if not missing:
            return
        kept_grads = [shard.grad for shard in shards]
        learning_rates = [group["lr"] for group in self.optimizer.param_groups]
        for shard in shards:  # a shard without a gradient is not stepped: its state stays as it is
            shard.grad = torch.zeros_like(shard) if any(shard is m for m in missing) else None
        for group in self.optimizer.param_groups:
            group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
        try:
            with torch.no_grad():
                self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, learning_rates):
                group["lr"] = lr
            for shard, grad in zip(shards, kept_grads):
                shard.grad = grad

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
