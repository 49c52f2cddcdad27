"""torchpar.keep_freed_memory: a step that frees and allocates again no longer faults its memory back in, whatever
glibc was told at launch."""
import subprocess
import sys

from test_torchrun import clean_env

# 64 tensors of 1 MiB written and freed, twenty times.
FAULTS_PER_ROUND = """
import resource, sys, torch, torchpar
if sys.argv[1] == "keep":
    torchpar.keep_freed_memory()
kept = torchpar.allocator.keeping_freed_memory()
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


def test_kept_memory_is_not_faulted_back_in_whatever_glibc_was_told():
    # MALLOC_TRIM_THRESHOLD_ set at launch fixes glibc's limits at their smallest (every block of 128 KiB mapped
    # apart and unmapped when freed): without torchpar's cache each round faults its 64 MiB in afresh, which also
    # shows that the count would see faults.
    for launch in ({}, {"MALLOC_TRIM_THRESHOLD_": "1"}):
        kept, faults = faults_per_round("keep", **launch)
        assert kept == "True"
        assert faults < 512, launch  # 64 MiB is 16,384 pages
    kept, faults = faults_per_round("plain", MALLOC_TRIM_THRESHOLD_="1")
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
