#!/usr/bin/env bash
# The main job, as a user runs it: the all-reduce examples under torchrun, C++ and Python, on one
# node and as two nodes of two ranks forming one world of four; then the planner on the digits MLP and
# the training examples with every strategy, ending with one table (scripts/demo_strategies.py); last, sharded data
# parallelism training a model whose peak per rank stays under a memory cap that DDP's would exceed (ZeRO stage 3
# under one that stage 2's would exceed too), and stage 1 refused (examples/python/train_sharded.py is the same
# program).
set -euo pipefail
cd "$(dirname "$0")/.."
demo=build/examples/cpp/allreduce_demo
run() { echo; echo "\$ $*"; "$@" 2>&1 | grep -v "OMP_NUM_THREADS\|^W.*run.py.*\*\*\*\|^W.*run.py:[0-9]*\] $"; }

run torchrun --nproc-per-node=2 --no-python "$demo"
run torchrun --nproc-per-node=2 examples/python/allreduce_demo.py
echo; echo "\$ TORCHPAR_BACKEND=shm torchrun --nproc-per-node=4 ...    # the same program on torchpar's shared-memory backend"
TORCHPAR_BACKEND=shm torchrun --nproc-per-node=4 --no-python "$demo" 2>&1 | grep "^rank"
echo; echo "\$ two torchrun invocations (--nnodes=2 --node-rank=0/1, loopback rendezvous): one world of 4 ranks"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
common=(--nnodes=2 --nproc-per-node=2 --master-addr=127.0.0.1 --master-port="$port" --no-python "$demo")
torchrun --node-rank=1 "${common[@]}" 2>/dev/null &
torchrun --node-rank=0 "${common[@]}" 2>/dev/null
wait
echo; echo "\$ $demo    # launched without torchrun: one line saying what is missing"
"$demo" 2>&1 || echo "(exit code $?)"
echo; echo "\$ python3 -m torchpar.plan --model torchpar.plan.examples:digits_deep_mlp --batch 64 --world 2   # which strategy?"
python3 -m torchpar.plan --model torchpar.plan.examples:digits_deep_mlp --batch 64 --world 2 --out build/demo-plan 2>&1 |
  sed -n '/  # |/,/^excluded/p' | head -8
echo; echo "\$ python3 scripts/demo_strategies.py   # train with every strategy (examples/, C++ and Python), one table"
python3 scripts/demo_strategies.py
echo; echo "\$ torchrun --nproc-per-node=4 --no-python build/examples/cpp/train_sharded --stage 3 --memory-per-rank 48MiB   # ZeRO-3 at a peak DDP and ZeRO-2 exceed"
torchrun --nproc-per-node=4 --no-python build/examples/cpp/train_sharded --stage 3 --memory-per-rank 48MiB 2>&1 |
  grep -v "OMP_NUM_THREADS\|^W.*run.py"
echo; echo "\$ torchrun --nproc-per-node=4 --no-python build/examples/cpp/train_sharded --stage 2 --memory-per-rank 64MiB   # ZeRO-2 at a peak DDP exceeds"
torchrun --nproc-per-node=4 --no-python build/examples/cpp/train_sharded --stage 2 --memory-per-rank 64MiB 2>&1 |
  grep "^train_sharded"
echo; echo "\$ torchrun --nproc-per-node=4 --no-python build/examples/cpp/train_sharded --stage 1 --memory-per-rank 64MiB   # refused: exit status 2"
torchrun --nproc-per-node=4 --no-python build/examples/cpp/train_sharded --stage 1 --memory-per-rank 64MiB 2>&1 |
  grep "^train_sharded" || true
