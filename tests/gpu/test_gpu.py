"""The paths that need a GPU (scripts/gpu_check.sh runs this file; the normal suite never collects it):
DDP, pipeline and parameter server with CUDA tensors on Gloo, two ranks sharing one GPU; DDP on NCCL with one
rank per GPU (one rank when there is one GPU); each against single-process training on the same GPU."""
import copy
import pathlib
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))

import torchpar  # noqa: E402
import torchpar.pipeline  # noqa: E402
import torchpar.ps  # noqa: E402
from ddp_reference import global_batches, make_model, max_difference, train_step_beside_reference  # noqa: E402
from rank_harness import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPUS = torch.cuda.device_count()
STEPS, PER_RANK = 4, 6


def device_of(rank: int) -> torch.device:
    return torch.device("cuda", rank % GPUS)


def ddp_matches_one_process(rank, world):
    device = device_of(rank)
    torch.cuda.set_device(device)
    model = make_model("mlp").to(device)
    reference = copy.deepcopy(model)
    ddp = torchpar.DistributedDataParallel(model, device_ids=[device.index], bucket_cap_mb=1e-4)
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, reference))
    for batch in global_batches("mlp", STEPS, world, PER_RANK):
        batch = tuple(t.to(device) for t in batch)
        train_step_beside_reference(ddp, optimizer, reference, reference_optimizer, batch, rank, world)
    return max_difference(model, reference)


def test_ddp_with_cuda_tensors_on_gloo_two_ranks_sharing_a_gpu():
    assert max(run_on_ranks(2, ddp_matches_one_process, backend="gloo")) < 1e-5


@pytest.mark.parametrize("world", sorted({1, min(GPUS, 4)}))
def test_ddp_on_nccl_one_rank_per_gpu(world):
    assert max(run_on_ranks(world, ddp_matches_one_process, backend="nccl")) < 1e-5


def pipeline_matches_one_process(rank, world):
    device = device_of(rank)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    layers = [nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 5)]
    reference = nn.Sequential(*copy.deepcopy(layers)).to(device)
    pipe = torchpar.pipeline.Pipeline([layer.to(device) for layer in layers], nn.functional.cross_entropy,
                                      microbatches=2, schedule="1f1b", balance=[2, 3])
    x, y = torch.randn(8, 12, device=device), torch.randint(0, 5, (8,), device=device)
    loss = pipe.step(x if pipe.is_first_stage else None, y if pipe.is_last_stage else None)
    expected = nn.functional.cross_entropy(reference(x), y)
    expected.backward()
    by_name = dict(reference.named_parameters())
    own = dict(pipe.stage_modules.named_parameters())
    offsets = {"0": 0, "1": 2}  # stage -> index of its first layer in the whole model
    difference = 0.0
    for name, parameter in own.items():
        stage, layer, attribute = name.split(".")
        reference_parameter = by_name[f"{offsets[stage] + int(layer)}.{attribute}"]
        difference = max(difference, (parameter.grad - reference_parameter.grad).abs().max().item())
    return abs(float(loss) - expected.item()), difference


def test_pipeline_with_cuda_stages_on_gloo_two_ranks_sharing_a_gpu():
    for loss_difference, gradient_difference in run_on_ranks(2, pipeline_matches_one_process, backend="gloo"):
        assert loss_difference < 1e-5 and gradient_difference < 1e-5


def parameter_server_with_cuda_model(rank, world):
    service = torchpar.ps.ParameterService(servers=1, consistency="bsp", stats_interval=3600)
    if service.is_server:
        service.serve()
        return None
    device = device_of(rank)
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    reference = copy.deepcopy(model)
    params = torchpar.ps.RemoteParameters(model, service.client, torchpar.ps.SGD(lr=0.5))
    x = torch.randn(4, 4, device=device)
    model(x).sum().backward()
    params.step()
    reference(x).sum().backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * p.grad
    service.finish()
    assert all(p.device == device for p in model.parameters())
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))


def test_parameter_server_with_a_cuda_model():
    # One worker: BSP's mean is its own gradient, so the reference is plain SGD on the GPU.
    assert run_on_ranks(2, parameter_server_with_cuda_model, backend="gloo")[0] < 1e-5
