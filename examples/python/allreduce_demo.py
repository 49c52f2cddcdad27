"""Every rank contributes [r*4 .. r*4+3]; after a sum all-reduce each rank checks and prints it.

    torchrun --nproc-per-node=2 examples/python/allreduce_demo.py
"""
import sys

import torch
import torch.distributed as dist

import torchpar

LENGTH = 4


def main() -> int:
    try:
        torchpar.init_process_group()
    except torchpar.LaunchError as error:
        print(f"allreduce_demo.py: {error}", file=sys.stderr)
        return 2
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor = torch.arange(LENGTH, dtype=torch.float64) + rank * LENGTH
    dist.all_reduce(tensor)
    expected = torch.arange(LENGTH, dtype=torch.float64) * world + LENGTH * world * (world - 1) / 2
    correct = torch.allclose(tensor, expected)
    # One write per line: ranks share the terminal, and print() would write the newline separately.
    sys.stdout.write(f"rank {rank}/{world}: all_reduce(sum) = {tensor.tolist()} {'correct' if correct else 'WRONG'}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
