"""One torchrun job: the same LightningModule fitted and validated on the shm backend under Lightning's own
DDPStrategy (torch's DDP) and under torchpar's TorchparDDPStrategy; each rank writes its final weights and
validation metrics to OUT/rank<r>.pt. tests/clients/test_lightning.py compares them to one process.

    torchrun --standalone --nproc-per-node=2 tests/clients/lightning_job.py OUT
"""
import os
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchpar  # noqa: F401  registers the "shm" backend
from torchpar.lightning import TorchparDDPStrategy

SAMPLES, FEATURES, CLASSES, BATCH_PER_RANK, EPOCHS, LR = 64, 8, 3, 8, 2, 0.1


def data(seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return TensorDataset(x, (x.sum(1) * 3).long().remainder(CLASSES))


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = network()

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        # sync_dist: Lightning all-reduces the sum and the int64 sample count with ReduceOp.AVG on non-gloo groups.
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def run(strategy, root: str) -> dict:
    model = Classifier()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=root,
    )
    train = DataLoader(data(1), batch_size=BATCH_PER_RANK)
    validation = DataLoader(data(2), batch_size=BATCH_PER_RANK)
    trainer.fit(model, train, validation)
    # Lightning unwraps a model at the end of fit only when isinstance(model, DistributedDataParallel).
    unwrapped = trainer.strategy.model is model
    fitted_validation = float(trainer.callback_metrics["val_loss"])
    validated = trainer.validate(model, validation, verbose=False)[0]["val_loss"]
    return {
        "weights": {k: v.detach().clone() for k, v in model.net.state_dict().items()},
        "fit_val_loss": fitted_validation,
        "validate_val_loss": float(validated),
        "wrapper_unwrapped": unwrapped,
    }


def main() -> None:
    out = sys.argv[1]
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    results = {
        "torch": run(DDPStrategy(process_group_backend="shm"), out),
        "torchpar": run(TorchparDDPStrategy(process_group_backend="shm"), out),
        "backend": torch.distributed.get_backend(),
    }
    torch.save(results, os.path.join(out, f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    main()
