"""torchpar as others consume it: find_package(torchpar) from an outside CMake project, the Python
package from any directory, and a regular (non-editable) wheel that carries its libtorchpar."""
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 600


def run(*command, **kwargs):
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def public_headers() -> set[str]:
    """torchpar/torchpar.h and every torchpar header it includes, transitively."""
    found, pending = set(), ["torchpar/torchpar.h"]
    while pending:
        header = pending.pop()
        if header not in found:
            found.add(header)
            pending += re.findall(r"^#include <(torchpar/[^>]+)>", (ROOT / "csrc" / header).read_text(), re.M)
    return found


def test_outside_cmake_project_builds_against_the_installed_package(build_dir, tmp_path):
    prefix = tmp_path / "prefix"
    run("cmake", "--install", build_dir, "--prefix", prefix)
    assert (prefix / "lib" / "cmake" / "torchpar" / "torchparConfig.cmake").exists()
    assert (prefix / "include" / "torchpar" / "torchpar.h").exists()
    installed = {str(p.relative_to(prefix / "include")) for p in (prefix / "include").rglob("*.h")}
    assert installed == public_headers(), "the installed headers are not the umbrella header's closure"
    assert "torchpar/comm/shm/communicator.h" not in installed  # an internal class stays internal

    outside = tmp_path / "outside"
    run("cmake", "-S", ROOT / "examples" / "cpp", "-B", outside, "-G", "Ninja", f"-DCMAKE_PREFIX_PATH={prefix}",
        "-DCMAKE_BUILD_TYPE=Release")
    cache = (outside / "CMakeCache.txt").read_text()
    assert f"torchpar_DIR:PATH={prefix}/lib/cmake/torchpar" in cache, "found another torchpar than the one installed"
    # One program proves the package links and runs; the build of every example is the main build's.
    run("cmake", "--build", outside, "-j2", "--target", "allreduce_demo")
    result = run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--no-python",
                 outside / "allreduce_demo")
    assert result.stdout.count("correct") == 2, result.stdout


def test_installed_package_imports_from_any_directory(tmp_path):
    """What scripts/setup.sh installed (pip install -e .) is this checkout, without PYTHONPATH's help."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = run(sys.executable, "-c", "import torchpar; print(torchpar.__file__); print(torchpar._C.__file__)",
                 cwd=tmp_path, env=env)
    package = ROOT / "python" / "torchpar"
    assert result.stdout.splitlines()[0] == str(package / "__init__.py"), result.stdout
    assert result.stdout.splitlines()[1].startswith(str(package / "_C")), result.stdout


def test_regular_wheel_carries_the_extension_and_its_library(tmp_path):
    run(sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", tmp_path / "wheel", ROOT)
    wheel = next((tmp_path / "wheel").glob("torchpar-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("torchpar/_C") and n.endswith(".so") for n in names), names
    assert any(n.startswith("torchpar/libtorchpar.so") for n in names), names

    site = tmp_path / "site"
    run(sys.executable, "-m", "pip", "install", "--no-deps", "--target", site, wheel)
    probe = ("import torchpar, sys; assert torchpar.__file__.startswith(sys.argv[1]), torchpar.__file__; "
             "maps = open('/proc/self/maps').read(); "
             "assert sys.argv[1] + '/torchpar/libtorchpar.so' in maps, 'libtorchpar not loaded from the wheel'; "
             "print(torchpar.read_launch_config(rank=0, world_size=1, has_store=True).world_size)")
    result = run(sys.executable, "-c", probe, site, cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert result.stdout.strip() == "1"
