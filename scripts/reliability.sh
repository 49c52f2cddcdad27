#!/usr/bin/env bash
# The runs beyond scripts/test.sh that measure torchpar against what others wrote and against faults
# (docs/testing.md has their latest figures). CI (.ci/run) runs it after the test command.
#
#   ./scripts/reliability.sh              # everything, ~35 min on 2 cores
#   CHAOS_TRIALS=5 SOAK_SECONDS=20 ./scripts/reliability.sh    # a quicker pass
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
status=0
summary=()
run() {
  local start=$SECONDS name=$1
  echo "=== $name ==="
  shift
  if "$@"; then
    summary+=("passed: $name")
  else
    status=1
    summary+=("FAILED: $name")
  fi
  echo "--- $((SECONDS - start)) s"
}
run "PyTorch's distributed suite on gloo and shm (tests/peer)" python3 tests/peer/run.py
run "chaos: ranks killed and frozen at random (tests/chaos)" python3 tests/chaos/run.py --trials "${CHAOS_TRIALS:-12}"
run "soak: parameter server and shm under load (tests/soak)" python3 tests/soak/run.py --seconds "${SOAK_SECONDS:-60}"
printf '%s\n' "${summary[@]}"
exit $status
