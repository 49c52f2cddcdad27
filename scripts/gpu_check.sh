#!/usr/bin/env bash
# The checks that need a GPU, for a machine that has one (never part of scripts/test.sh): builds with CUDA
# and NCCL, runs the C++ CUDA test (DataParallel over the visible GPUs), the GPU tests of tests/gpu/ (DDP,
# pipeline and parameter server with CUDA tensors on Gloo, two ranks sharing a GPU; DDP on NCCL, one rank
# per GPU), and a short DDP benchmark, torch's against torchpar's, on NCCL. Meant to finish within 8 minutes.
#
#   ./scripts/gpu_check.sh            # after scripts/setup.sh (or TORCHPAR_USE_INSTALLED_TORCH=1 scripts/setup.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
log() { printf '\033[1m[gpu_check]\033[0m %s\n' "$*"; }
start=$SECONDS
status=0

if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  log "no CUDA device visible to torch: nothing to check here"
  exit 1
fi
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
log "$gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs)"

log "building (CUDA and NCCL paths are compiled when torch has CUDA)"
cmake --build build -j"$(nproc)" || exit 1

log "C++: the CUDA test cases"
ctest --test-dir build -R "cuda|CUDA" --output-on-failure || status=1

log "Python: tests/gpu"
python3 -m pytest tests/gpu -q -p no:cacheprovider || status=1

log "benchmark: DDP on NCCL, torch's beside torchpar's"
timeout 180 python3 -m torch.distributed.run --nproc-per-node="$gpus" tests/gpu/ddp_nccl_benchmark.py || status=1

log "done in $((SECONDS - start)) s: $([ $status = 0 ] && echo 'every check passed' || echo 'FAILURES above')"
exit $status
