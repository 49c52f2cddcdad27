import os
import pathlib
import socket

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("TORCHPAR_BUILD_DIR", ROOT / "build"))


@pytest.fixture
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def build_dir() -> pathlib.Path:
    if not (BUILD / "CMakeCache.txt").exists():
        pytest.fail(f"no CMake build in {BUILD}: run scripts/setup.sh first")
    return BUILD
