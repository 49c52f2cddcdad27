"""torchpar: data, pipeline and parameter-server parallelism for LibTorch (C++) and PyTorch.

The C++ engine lives in ``torchpar._C``; this package is its thin Python face.
"""
import torch
import torch.distributed  # registers c10d's Python types (Store, ProcessGroup) that _C hands out

from . import _C, checkpoint, ddp, pipeline, ps
from .backends import register_backends
from .comm import LaunchError, init_process_group, read_launch_config
from .ddp import DistributedDataParallel

register_backends()

__version__ = "0.1.0"

__all__ = ["DistributedDataParallel", "LaunchError", "init_process_group", "read_launch_config", "__version__"]
