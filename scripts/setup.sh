#!/usr/bin/env bash
# Installs everything torchpar needs on a fresh Debian 12 machine and builds it. Idempotent: a
# second run installs nothing and rebuilds only what changed.
#
#   TORCHPAR_USE_INSTALLED_TORCH=1  build against the torch already installed (any 2.11–2.15)
#                                   instead of installing the version pinned in requirements.txt
#   TORCHPAR_INSTALL_PREFIX=DIR     where `cmake --install` puts libtorchpar and its CMake package
#                                   (default /usr/local, so find_package(torchpar) needs no hints)
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
start=$SECONDS

# 1. Debian packages: Catch2 v2 (C++ tests), ccache and ninja (build speed), gloo's headers (c10d's
#    ProcessGroupGloo.hpp needs them and the torch wheel does not ship them; see docs/building.md).
debian_packages=(catch2 ccache ninja-build libgloo-dev cmake g++)
missing=()
for package in "${debian_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
else
  log "Debian packages present"
fi

# 2. Python packages into the machine's Python (CI's fresh clone must find them there).
PYTHON=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
pinned_torch=$(sed -n 's/^torch==//p' requirements.txt)
installed_torch=$($PYTHON -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "${TORCHPAR_USE_INSTALLED_TORCH:-0}" = 1 ] && [ -n "$installed_torch" ]; then
  log "using the installed torch $installed_torch (TORCHPAR_USE_INSTALLED_TORCH=1)"
  grep -v '^torch==' requirements.txt | $PYTHON -m pip install -q -r /dev/stdin
elif [ "$installed_torch" = "$pinned_torch" ]; then
  log "torch $pinned_torch already installed; checking the other Python requirements"
  $PYTHON -m pip install -q -r requirements.txt
else
  log "installing torch $pinned_torch (CUDA 13 build, several GB) and the other Python requirements"
  $PYTHON -m pip install -q -r requirements.txt
fi

# The real clients tests/clients/ runs torchpar inside (transformers, Lightning), with the torch now installed
# held fixed: a client's own requirements never change the torch version.
installed_torch=$($PYTHON -c 'import torch; print(torch.__version__.split("+")[0])')
$PYTHON -m pip install -q -r tests/clients/requirements.txt -c <(echo "torch==$installed_torch")

# 3. The digits data set for the training examples (examples/{cpp,python}/train_ddp), from the copy
#    bundled with scikit-learn (no download); written once, kept afterwards.
if [ -f data/digits.pt ]; then
  log "data/digits.pt present"
else
  log "writing data/digits.pt (scikit-learn's digits, fixed 80/20 split)"
  $PYTHON scripts/export_digits.py
fi
if [ -f data/docstrings.txt ]; then
  log "data/docstrings.txt present"
else
  log "writing data/docstrings.txt (docstrings of Python's standard library, for the GPT examples)"
  $PYTHON scripts/export_text.py
fi

# 4. Build (CMake: library, Python extension, tests, examples) and install.
log "building in build/"
mkdir -p build
# Torch's CMake package is chatty; its output stays in build/configure.log unless configuring fails.
cmake -S . -B build -G Ninja -DPython3_EXECUTABLE="$(command -v "$PYTHON")" >build/configure.log 2>&1 ||
  { cat build/configure.log; exit 1; }
cmake --build build -j2
log "installing libtorchpar and its CMake package into ${TORCHPAR_INSTALL_PREFIX:-/usr/local}"
cmake --install build --prefix "${TORCHPAR_INSTALL_PREFIX:-/usr/local}" >/dev/null
log "installing the Python package (editable)"
$PYTHON -m pip install -q --no-build-isolation --no-deps -e .

log "done in $((SECONDS - start)) s"
