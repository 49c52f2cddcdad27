"""torchpar.keep_freed_memory: a step that frees and allocates again no longer faults its memory back in."""
import subprocess
import sys

from test_torchrun import clean_env

# 64 tensors of 1 MiB written and freed, twenty times.
FAULTS_PER_ROUND = """
import resource, sys, torch, torchpar
kept = torchpar.keep_freed_memory() if sys.argv[1] == "keep" else None
def faults_per_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        tensors = [torch.ones(1 << 18) for _ in range(64)]
        del tensors
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20
faults_per_round()
print(kept, faults_per_round())
"""


def faults_per_round(mode, **env):
    result = subprocess.run([sys.executable, "-c", FAULTS_PER_ROUND, mode], capture_output=True, text=True,
                            timeout=120, env=clean_env(**env))
    assert result.returncode == 0, result.stderr
    kept, faults = result.stdout.split()
    return kept, float(faults)


def test_kept_memory_is_not_faulted_back_in():
    kept, faults = faults_per_round("keep")
    assert kept == "True"
    assert faults < 512  # 64 MiB is 16,384 pages


def test_the_launchs_own_allocator_settings_win():
    # Set at launch, either variable fixes both limits at once (the mapping one at its 128 KiB default): every
    # tensor here is then mapped and faulted in afresh, which also shows that the count above would see faults.
    kept, faults = faults_per_round("keep", MALLOC_TRIM_THRESHOLD_="1")
    assert kept == "False"
    assert faults > 8192


# Exact byte counts: what is allocated and freed through LibTorch's CPU allocator once counting began.
COUNTED = """
import threading, numpy, torch
from torchpar import allocator
before = torch.ones(1000)                     # allocated before counting: neither it nor its release counts
allocator.count_cpu_allocations()
allocator.count_cpu_allocations()             # idempotent
a = torch.empty(1 << 20)                      # 4 MiB
b = torch.empty(256, dtype=torch.float64)     # 2 KiB
assert (allocator.cpu_memory_allocated(), allocator.cpu_max_memory_allocated()) == (4 * 2**20 + 2048, 4 * 2**20 + 2048)
del a, before
assert allocator.cpu_memory_allocated() == 2048 and allocator.cpu_max_memory_allocated() == 4 * 2**20 + 2048
allocator.reset_cpu_peak_memory()
assert allocator.cpu_max_memory_allocated() == 2048
from_numpy = torch.from_numpy(numpy.ones(1000))  # numpy's memory, not the allocator's
b.untyped_storage().resize_(4096)             # a resize allocates anew and frees the old
assert allocator.cpu_memory_allocated() == 4096 and allocator.cpu_max_memory_allocated() == 4096 + 2048
weight = torch.ones(256, 256, requires_grad=True)
thread = threading.Thread(target=lambda: (weight * 2).sum().backward())  # another thread's allocations count
thread.start(); thread.join()
assert weight.grad is not None and allocator.cpu_memory_allocated() == 4096 + 2 * 256 * 256 * 4
print("ok")
"""


def test_cpu_allocations_are_counted_to_the_byte():
    result = subprocess.run([sys.executable, "-c", COUNTED], capture_output=True, text=True, timeout=120,
                            env=clean_env())
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
