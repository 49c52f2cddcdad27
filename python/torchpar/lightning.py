"""PyTorch Lightning on torchpar's DistributedDataParallel: ``Trainer(strategy=TorchparDDPStrategy(...))``.

    import lightning as L
    from torchpar.lightning import TorchparDDPStrategy

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TorchparDDPStrategy(process_group_backend="shm"))
    trainer.fit(model, train_loader, val_loader)

Lightning's own ``DDPStrategy`` with every argument it takes (``find_unused_parameters``, ``static_graph``,
``bucket_cap_mb``, ``process_group_backend`` …); only the wrapper differs. Lightning's default strategy works on
torchpar's ``shm`` backend as it is (``DDPStrategy(process_group_backend="shm")`` after ``import torchpar``).
"""
from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn

from .ddp import DistributedDataParallel

__all__ = ["TorchparDDPStrategy"]


class TorchparDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy with torchpar's ``DistributedDataParallel`` around the LightningModule."""

    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)

    # Lightning's manual optimisation drives torch's Reducer by hand before and after backward; torchpar's
    # forward already prepared the backward it will synchronise, so there is nothing to add.
    def pre_backward(self, closure_loss: Tensor) -> None:
        pass

    def post_backward(self, closure_loss: Tensor) -> None:
        pass
