"""Pipeline parallelism: a model cut into stages on different ranks, trained on micro-batches.

    layers = [nn.Linear(64, 256), nn.ReLU(), ..., nn.Linear(256, 10)]     # or an nn.Sequential,
    pipe = torchpar.pipeline.Pipeline(layers, nn.functional.cross_entropy,  # or factories building
                                      schedule="1f1b", microbatches=8)     # only what a rank needs
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    optimizer.zero_grad()
    loss = pipe.step(x, y)             # forward + backward of the batch through every stage
    optimizer.step()

The schedules (``gpipe``, ``1f1b``, ``interleaved``, ``zero_bubble``), the simulator and the
partitioner are the C++ engine's; see them before running with ``python -m torchpar.pipeline.show``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from torchpar._C import pipeline as _engine
from torchpar.same_host import shm_group_beside

logger = logging.getLogger("torchpar.pipeline")

__all__ = [
    "Pipeline",
    "SCHEDULES",
    "balanced_partition",
    "hybrid_groups",
    "simulate",
    "simulate_stages",
    "uniform_partition",
]

SCHEDULES = tuple(_engine.schedule_names())
simulate = _engine.simulate
simulate_stages = _engine.simulate_stages
balanced_partition = _engine.balanced_partition
uniform_partition = _engine.uniform_partition

LayerSpec = Union[nn.Module, Callable[[], nn.Module]]
# One parameter of one layer: (layer index or name, parameter name or position), or "layer.parameter.path".
ParameterSpec = Union[str, tuple[Union[int, str], Union[str, int]]]


def _as_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and all(isinstance(item, torch.Tensor) for item in value):
        return list(value)
    raise TypeError(f"a pipeline layer must return a tensor or a tuple of tensors, got {type(value).__name__}")


def _plain_linear(module: nn.Module) -> bool:
    """An nn.Linear whose forward nothing intercepts: the engine may run it as its own linear layer."""
    hooks = nn.modules.module
    return type(module) is nn.Linear and not (
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
        or hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks)


def _layer(name: str, module: nn.Module) -> _engine.Layer:
    if _plain_linear(module):
        # Its backward adds the weight gradient into .grad with one addmm_ (see linear_layer.h).
        return _engine.linear_layer(name, module.weight, module.bias)
    named = list(module.named_parameters())
    return _engine.Layer(name, lambda tensors: _as_tensors(module(*tensors)), [p for _, p in named],
                         [n for n, _ in named])


def _parameter_ref(member: ParameterSpec, names: list[str]) -> tuple[int, str | int]:
    """A member of a ``shared_parameters`` group as the engine addresses it: (layer index, name or position)."""
    if isinstance(member, str):
        layer, _, parameter = member.partition(".")
        if not parameter:
            raise ValueError(f"shared_parameters: {member!r} names no parameter; write 'layer.parameter' "
                             f"(e.g. '{names[0] if names else 0}.weight') or (layer, 'parameter')")
    elif isinstance(member, (tuple, list)) and len(member) == 2:
        layer, parameter = member
    else:
        raise TypeError(f"shared_parameters: {member!r} is not (layer, parameter name or position) nor 'layer.parameter'")
    if isinstance(layer, str):
        if layer not in names:
            raise ValueError(f"shared_parameters: no layer named {layer!r}; the layers are {names}")
        layer = names.index(layer)
    if isinstance(parameter, bool) or not isinstance(parameter, (int, str)) or not isinstance(layer, int):
        raise TypeError(f"shared_parameters: {member!r} is not (layer, parameter name or position)")
    return int(layer), parameter


class Pipeline:
    """One pipeline over ``process_group`` (default: the whole world); virtual stage k on rank k % size.

    Args:
        layers: an ``nn.Sequential``, or a sequence whose items are modules or zero-argument
            callables building one (factories: each rank builds only its own stages' layers).
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage, for one micro-batch; the
            mean over micro-batches is what ``step`` returns and differentiates.
        microbatches: micro-batches per step; the batch size must be divisible by it.
        schedule: one of ``SCHEDULES``.
        virtual_stages: stages per rank (``"interleaved"`` only).
        balance: layers per stage (a list), or how to choose them: ``"uniform"`` (layer count),
            ``"parameters"``, or ``"time"`` (each layer's forward+backward measured on
            ``sample_input``, one micro-batch, then the partition minimising the slowest stage).
        data_parallel_group: pipeline x data parallelism: the ranks holding the same stages in the
            other replicas; their gradients are averaged at the end of each step (see ``hybrid_groups``),
            through an shm group beside it when it is Gloo on one host (``TORCHPAR_DDP_SAME_HOST=0``: not).
        checkpoint: recompute each stage's forward in backward instead of keeping its activations.
        loss_on: ``"all"`` (every rank gets the loss) or ``"last"`` (only the last stage's rank;
            ``None`` elsewhere, no broadcast).
        shared_parameters: tied parameters, groups of parameters that are one (GPT-2's embedding and
            LM head): each member ``(layer, parameter)`` (layer index or name, parameter name as the
            layer's ``named_parameters`` says, or position) or ``"layer.parameter"``, e.g.
            ``[[(0, "weight"), (11, "weight")]]``. Layers given as modules need none for a parameter
            object two of them hold: it is found. The copies start equal (the lowest layer's values)
            and each step sums their gradients over the ranks holding them.
    """

    def __init__(
        self,
        layers: nn.Sequential | Sequence[LayerSpec],
        loss_fn: Callable[..., torch.Tensor],
        *,
        microbatches: int,
        schedule: str = "1f1b",
        virtual_stages: int = 1,
        balance: Sequence[int] | str | None = None,
        sample_input: torch.Tensor | Sequence[torch.Tensor] | None = None,
        process_group: dist.ProcessGroup | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        checkpoint: bool = False,
        loss_on: str = "all",
        bucket_cap_mb: float = 25.0,
        shared_parameters: Sequence[Sequence[ParameterSpec]] | None = None,
    ):
        if loss_on not in ("all", "last"):
            raise ValueError(f"loss_on must be 'all' or 'last', got {loss_on!r}")
        specs = list(layers.children()) if isinstance(layers, nn.Sequential) else list(layers)
        names = list(dict(layers.named_children())) if isinstance(layers, nn.Sequential) else [
            str(i) for i in range(len(specs))
        ]
        self._built: dict[int, nn.Module] = {}

        def factory(index: int) -> Callable[[], _engine.Layer]:
            def build() -> _engine.Layer:
                spec = specs[index]
                module = spec if isinstance(spec, nn.Module) else spec()
                if not isinstance(module, nn.Module):
                    raise TypeError(f"pipeline layer {index}: the factory returned {type(module).__name__}, not an nn.Module")
                self._built[index] = module
                return _layer(names[index], module)

            return build

        declared = [[_parameter_ref(member, names) for member in group] for group in shared_parameters or []]
        if all(isinstance(spec, nn.Module) for spec in specs):
            # Every layer is at hand: the engine finds the parameter objects two layers share.
            declared = _engine.shared_parameters_of([_layer(names[i], spec) for i, spec in enumerate(specs)], declared)
        explicit = [int(n) for n in balance] if balance is not None and not isinstance(balance, str) else []
        balance_by = balance if isinstance(balance, str) else "uniform"
        samples = [] if sample_input is None else _as_tensors(sample_input)
        group = process_group if process_group is not None else dist.group.WORLD
        if data_parallel_group is not None:
            # The replicas' gradient averages are bulk data: through shared memory when they share this host.
            data_parallel_group = shm_group_beside(data_parallel_group, torch.device("cpu")) or data_parallel_group
        self._engine = _engine.Pipeline(
            [factory(i) for i in range(len(specs))],
            lambda outputs, target: loss_fn(outputs[0] if len(outputs) == 1 else tuple(outputs), target),
            group,
            data_parallel_group,
            schedule,
            microbatches,
            virtual_stages,
            explicit,
            balance_by,
            samples,
            checkpoint,
            loss_on == "all",
            bucket_cap_mb,
            declared,
        )
        boundaries = [0]
        for count in self._engine.balance:
            boundaries.append(boundaries[-1] + count)
        own = {i for stage in self._engine.stages() for i in range(boundaries[stage], boundaries[stage + 1])}
        # Balancing may have built (and dropped) other stages' layers; keep this rank's only.
        self._built = {i: m for i, m in sorted(self._built.items()) if i in own}
        self.stage_modules = nn.ModuleDict(
            {
                str(stage): nn.Sequential(*[self._built[i] for i in range(boundaries[stage], boundaries[stage + 1])])
                for stage in self._engine.stages()
            }
        )
        if group.rank() == 0:
            logger.info("pipeline partition (%s, %d micro-batches):\n%s", schedule, microbatches,
                        self._engine.partition_report.rstrip())
            if self._engine.shared_parameters_report:
                logger.info("pipeline tied parameters:\n%s", self._engine.shared_parameters_report.rstrip())

    def step(self, inputs: torch.Tensor | Sequence[torch.Tensor] | None, target: torch.Tensor | None = None):
        """Forward and backward of one batch; gradients accumulate into this rank's parameters."""
        tensors = [] if inputs is None else _as_tensors(inputs)
        loss = self._engine.step(tensors, target)
        return loss

    def forward(self, inputs: torch.Tensor | Sequence[torch.Tensor] | None):
        """Forward only, without gradients: the last stage's output on its rank, None elsewhere."""
        outputs = self._engine.forward([] if inputs is None else _as_tensors(inputs))
        if not outputs:
            return None
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def parameters(self) -> list[torch.Tensor]:
        """This rank's parameters: what its optimizer steps on (a tied parameter once)."""
        return self._engine.parameters()

    @property
    def shared_parameters(self) -> list[list[tuple[int, str | int]]]:
        """The tied parameters, declared and found: groups of (layer index, parameter name or position)."""
        return self._engine.shared_parameters

    def state_dict(self) -> dict[str, Any]:
        """This rank's stages (their layers' parameters and buffers) and the cut they belong to: what
        each rank saves in a checkpoint (see torchpar.checkpoint)."""
        return {"balance": list(self.balance), "stages": list(self.stages), "modules": self.stage_modules.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads what ``state_dict`` returned on this rank; the pipeline must be cut the same way."""
        if state["balance"] != list(self.balance) or state["stages"] != list(self.stages):
            raise ValueError(
                f"this checkpoint holds stages {state['stages']} of the cut {state['balance']} (layers per stage); "
                f"this rank runs stages {list(self.stages)} of {list(self.balance)}: build the Pipeline with "
                f"balance={state['balance']} to resume it"
            )
        self.stage_modules.load_state_dict(state["modules"])

    @property
    def stages(self) -> list[int]:
        return self._engine.stages()

    @property
    def is_last_stage(self) -> bool:
        return self._engine.has_last_stage()

    @property
    def is_first_stage(self) -> bool:
        return 0 in self._engine.stages()

    @property
    def balance(self) -> list[int]:
        return self._engine.balance

    @property
    def partition_report(self) -> str:
        return self._engine.partition_report

    @property
    def shared_parameters_report(self) -> str:
        """One line per tied group: its stages and ranks, where its values came from (logged on rank 0)."""
        return self._engine.shared_parameters_report

    @property
    def actions(self):
        """This rank's schedule: the action list ``step`` executes."""
        return self._engine.actions

    @property
    def last_step_timeline(self):
        """The last step on this rank: compute actions with start/end in ms since the step began
        (``.action``, ``.start``, ``.end``), the measured counterpart of ``simulate(...).timeline``."""
        return self._engine.last_step_timeline

    @property
    def last_step_milliseconds(self) -> float:
        """The last step's duration on this rank, up to its last send (the loss broadcast excluded)."""
        return self._engine.last_step_milliseconds

    @property
    def last_step_waiting_milliseconds(self) -> float:
        """The part of the last step this rank spent blocked on transfers (activations and gradients to arrive,
        its sends to complete); the rest beyond the timeline's compute is host work."""
        return self._engine.last_step_waiting_milliseconds


def hybrid_groups(stages: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Pipeline x data parallel over the world: ranks d*stages .. d*stages+stages-1 form replica d's
    pipeline; ranks holding the same stage form its data-parallel group. Returns this rank's
    (pipeline group, data-parallel group); every rank must call it (it creates process groups)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % stages:
        raise ValueError(f"hybrid_groups: world size {world} is not a multiple of {stages} pipeline stages")
    replicas = world // stages
    pipeline_group = data_parallel_group = None
    for replica in range(replicas):
        group = dist.new_group([replica * stages + s for s in range(stages)])
        if rank // stages == replica:
            pipeline_group = group
    for stage in range(stages):
        group = dist.new_group([replica * stages + stage for replica in range(replicas)])
        if rank % stages == stage:
            data_parallel_group = group
    return pipeline_group, data_parallel_group
