"""The examples launched as users launch them: real torchrun subprocesses, C++ binary and script."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYTHON_DEMO = ROOT / "examples" / "python" / "allreduce_demo.py"
LAUNCH_TIMEOUT_S = 180
RESULT = re.compile(r"rank (\d+)/(\d+): all_reduce\(sum\) = \[([^\]]*)\] (\w+)")


@pytest.fixture(scope="module")
def cpp_demo(build_dir):
    binary = build_dir / "examples" / "cpp" / "allreduce_demo"
    assert binary.exists(), f"{binary} not built"
    return binary


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                          "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"}}
    env.update(extra)
    return env


def torchrun(*arguments, **env):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *map(str, arguments)],
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=clean_env(**env))


def check_results(output: str, world: int):
    """Every rank printed the closed-form sum and judged it correct."""
    found = {int(m[1]): m for m in RESULT.finditer(output)}
    assert sorted(found) == list(range(world)), output
    for match in found.values():
        assert int(match[2]) == world
        values = [float(v) for v in match[3].split(",")]
        assert values == [world * i + 4 * world * (world - 1) / 2 for i in range(4)], output
        assert match[4] == "correct"


@pytest.mark.parametrize("world", [2, 3])
def test_cpp_binary_under_torchrun(cpp_demo, free_port, world):
    result = torchrun(f"--nproc-per-node={world}", f"--master-port={free_port}", "--no-python", cpp_demo)
    assert result.returncode == 0, result.stderr
    check_results(result.stdout, world)


@pytest.mark.parametrize("program", ["cpp", "python"])
def test_shm_backend_under_torchrun(cpp_demo, free_port, program):
    target = ["--no-python", cpp_demo] if program == "cpp" else [PYTHON_DEMO]
    result = torchrun("--nproc-per-node=4", f"--master-port={free_port}", *target, TORCHPAR_BACKEND="shm")
    assert result.returncode == 0, result.stderr
    check_results(result.stdout, 4)


def test_python_script_under_torchrun(free_port):
    result = torchrun("--nproc-per-node=2", f"--master-port={free_port}", PYTHON_DEMO)
    assert result.returncode == 0, result.stderr
    check_results(result.stdout, 2)


@pytest.mark.parametrize("program", ["cpp", "python"])
def test_two_nodes_of_two_ranks_form_one_world_of_four(cpp_demo, free_port, program):
    target = ["--no-python", cpp_demo] if program == "cpp" else [PYTHON_DEMO]
    common = ["--nnodes=2", "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={free_port}"]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *common, f"--node-rank={node}",
                               *map(str, target)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_env())
             for node in (0, 1)]
    outputs = [node.communicate(timeout=LAUNCH_TIMEOUT_S) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs
    check_results(outputs[0][0] + outputs[1][0], 4)


def run_directly(command, **env):
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
                          env=clean_env(**env))


@pytest.mark.parametrize("program", ["cpp", "python"])
@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "environment variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"),
        (dict(RANK="0", WORLD_SIZE="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"), "WORLD_SIZE=0 must be at least 1"),
        (dict(RANK="3", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"), "RANK=3 is out of range"),
    ],
)
def test_wrong_launch_gives_one_line(cpp_demo, program, env, message):
    command = [cpp_demo] if program == "cpp" else [sys.executable, PYTHON_DEMO]
    result = run_directly(command, **env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]


@pytest.mark.parametrize("program", ["cpp", "python"])
def test_unreachable_master_gives_one_line_within_the_timeout(cpp_demo, free_port, program):
    command = [cpp_demo] if program == "cpp" else [sys.executable, PYTHON_DEMO]
    result = run_directly(command, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port),
                          TORCHPAR_TIMEOUT="2")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"could not reach the rendezvous store at 127.0.0.1:{free_port} within 2 s" in lines[0]


@pytest.mark.parametrize("program", ["cpp", "python"])
def test_missing_rank_is_reported_not_waited_for(cpp_demo, free_port, program):
    """Two ranks of a world of three: both say how many joined, within the timeout."""
    command = [cpp_demo] if program == "cpp" else [sys.executable, PYTHON_DEMO]
    env = dict(WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port), TORCHPAR_TIMEOUT="5")
    ranks = [subprocess.Popen([str(c) for c in command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_env(RANK=str(rank), **env)) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=LAUNCH_TIMEOUT_S) for rank in ranks]
    for rank, (_, stderr) in zip(ranks, outputs):
        assert rank.returncode == 2, stderr
        assert "only 2 of 3 ranks" in stderr and len(stderr.strip().splitlines()) == 1, stderr
