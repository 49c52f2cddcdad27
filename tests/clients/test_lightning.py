"""PyTorch Lightning's Trainer on torchpar: fit and validate (sync_dist logging) on the shm backend with
Lightning's DDPStrategy and with torchpar's TorchparDDPStrategy, against one process on the global batch."""
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler

from launched_job import job_environment

pytest.importorskip("lightning")
JOB = pathlib.Path(__file__).with_name("lightning_job.py")
sys.path.insert(0, str(JOB.parent))
import lightning_job  # noqa: E402


def one_process_reference():
    """Each step's global batch is both ranks' batches, dealt as Lightning deals them: its DistributedSampler
    shuffles the training set (seed 0, reshuffled each epoch)."""
    net = lightning_job.network()
    optimizer = torch.optim.SGD(net.parameters(), lr=lightning_job.LR)
    dataset = lightning_job.data(1)
    x, y = dataset.tensors
    for epoch in range(lightning_job.EPOCHS):
        shares = []
        for rank in range(2):
            sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
        size = lightning_job.BATCH_PER_RANK
        for start in range(0, len(shares[0]), size):
            batch = shares[0][start:start + size] + shares[1][start:start + size]
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x[batch]), y[batch]).backward()
            optimizer.step()
    vx, vy = lightning_job.data(2).tensors
    with torch.no_grad():
        return net.state_dict(), float(nn.functional.cross_entropy(net(vx), vy))


def test_lightning_fit_and_validate_on_shm_with_torch_and_torchpar_ddp(tmp_path):
    job = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(JOB), str(tmp_path)],
        env=job_environment(), capture_output=True, text=True, timeout=300,
    )
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    expected_weights, expected_loss = one_process_reference()
    for rank, result in enumerate(ranks):
        assert result["backend"] == "shm"
        for strategy in ("torch", "torchpar"):
            run = result[strategy]
            for name, value in expected_weights.items():
                torch.testing.assert_close(run["weights"][name], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} {strategy} {name}: {m}")
            assert run["fit_val_loss"] == pytest.approx(expected_loss, rel=1e-5), (rank, strategy)
            assert run["validate_val_loss"] == pytest.approx(expected_loss, rel=1e-5), (rank, strategy)
            assert run["wrapper_unwrapped"], f"Lightning did not unwrap the {strategy} DDP at teardown"
    for name in expected_weights:
        assert torch.equal(ranks[0]["torchpar"]["weights"][name], ranks[1]["torchpar"]["weights"][name])
