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
