"""Steps/s of torch's DistributedDataParallel and torchpar's on NCCL, one rank per GPU, alternated in the same
processes (scripts/gpu_check.sh launches it with torchrun). Prints a table row per round and the median ratio."""
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import torchpar

STEPS, ROUNDS = 30, 5


def steps_per_second(model, x, y, optimizer) -> float:
    for _ in range(3):  # warm-up: bucket rebuild, kernel selection
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    torch.cuda.synchronize()
    return STEPS / (time.perf_counter() - start)


def main() -> None:
    torchpar.init_process_group(backend="nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.ReLU()) for _ in range(8)]).cuda()
    x, y = torch.randn(64, 2048, device="cuda"), torch.randn(64, 2048, device="cuda")
    wrappers = {"torch": torch.nn.parallel.DistributedDataParallel, "torchpar": torchpar.DistributedDataParallel}
    models = {name: wrap(copy.deepcopy(base), device_ids=[rank]) for name, wrap in wrappers.items()}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=1e-3) for name, model in models.items()}
    ratios = []
    for round_ in range(ROUNDS):
        rates = {name: steps_per_second(models[name], x, y, optimizers[name]) for name in wrappers}
        ratios.append(rates["torchpar"] / rates["torch"])
        if rank == 0:
            print(f"round {round_}: torch {rates['torch']:.1f} steps/s, torchpar {rates['torchpar']:.1f} steps/s, "
                  f"torchpar/torch {ratios[-1]:.2f}", flush=True)
    if rank == 0:
        print(f"DDP on NCCL, {dist.get_world_size()} GPU(s), 8 x Linear(2048): median torchpar/torch "
              f"{statistics.median(ratios):.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
