"""torchpar: data, pipeline, parameter-server and tensor parallelism for LibTorch (C++) and PyTorch.

The C++ engine lives in ``torchpar._C``; this package is its thin Python face.
"""
import torch
import torch.distributed  # registers c10d's Python types (Store, ProcessGroup) that _C hands out

from . import _C, checkpoint, clean_exit, ddp, pipeline, ps, sharded, tensor_parallel
from .allocator import keep_freed_memory
from .backends import register_backends
from .comm import LaunchError, bind_cores, init_process_group, read_launch_config
from .ddp import DistributedDataParallel
from .sharded import ShardedDataParallel, ShardedOptimizer
from .tensor_parallel import ParallelGrid

register_backends()

__version__ = "0.1.0"

__all__ = ["DistributedDataParallel", "LaunchError", "ParallelGrid", "ShardedDataParallel", "ShardedOptimizer",
           "bind_cores", "init_process_group", "keep_freed_memory", "read_launch_config", "__version__"]
