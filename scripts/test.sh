#!/usr/bin/env bash
# Every test: the C++ suite (Catch2 via ctest) and the Python suite (pytest: tests/python, and tests/clients, torchpar
# inside Hugging Face models, Lightning and torch.distributed.checkpoint), on real ranks.
# Builds first (a no-op when nothing changed). Fails when any test fails or when none ran.
set -uo pipefail
cd "$(dirname "$0")/.."
cmake --build build -j2 || exit 1

# The tests import this checkout's package even where another checkout was installed last.
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
status=0
echo "=== C++ tests (ctest) ==="
ctest --test-dir build --output-on-failure --no-tests=error -j2 || status=1
echo "=== Python tests (pytest) ==="
# pytest exits 5 when it collected no test: that is a failure here too. The 25 slowest tests are listed
# so that a contributor sees where the time goes.
python3 -m pytest tests/python tests/clients -q -p no:cacheprovider --durations=25 || status=1
exit $status
