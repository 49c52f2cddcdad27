"""The examples launched as users launch them: real torchrun subprocesses, C++ binary and script."""
import json
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
        (dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", TORCHPAR_BIND_CORES="yes"),
         "TORCHPAR_BIND_CORES='yes' must be 1"),
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


BOUND_REPORT = """
import json, os, pathlib, sys, torch, torch.distributed as dist, torchpar
torchpar.init_process_group()
if os.environ.get("BIND_AFTER_INIT"):  # Gloo's and the store's threads run already
    torchpar.bind_cores()
threads = {task.name: next(line.split()[1] for line in (task / "status").read_text().splitlines()
                           if line.startswith("Cpus_allowed_list"))
           for task in pathlib.Path("/proc/self/task").iterdir()}
topology = pathlib.Path("/sys/devices/system/cpu")
cores = {tuple((topology / f"cpu{cpu}/topology" / field).read_text().strip() for field in ("physical_package_id", "core_id"))
         for cpu in os.sched_getaffinity(0)}
tensor = torch.ones(4)
dist.all_reduce(tensor)
# One write per line: the ranks share the pipe.
sys.stdout.write(json.dumps(dict(rank=dist.get_rank(), cpus=sorted(os.sched_getaffinity(0)), threads=threads,
                                 physical_cores=len(cores), intra_op=torch.get_num_threads(), sum=tensor.tolist())) + "\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


def physical_cores_available() -> int:
    """The physical cores this process may run on, as bind_cores counts them ((package, core) pairs: SMT siblings are one)."""
    topology = pathlib.Path("/sys/devices/system/cpu")
    return len({tuple((topology / f"cpu{cpu}/topology" / field).read_text() for field in ("physical_package_id", "core_id"))
                for cpu in os.sched_getaffinity(0)})


def cpu_list(text: str) -> set[int]:
    """/proc's Cpus_allowed_list ("0-2,5") as a set."""
    cpus = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


@pytest.mark.parametrize("how", [dict(TORCHPAR_BIND_CORES="1"), dict(BIND_AFTER_INIT="1")], ids=["at-init", "after-init"])
def test_bound_ranks_run_on_their_own_cores_with_every_thread(free_port, tmp_path, how):
    """TORCHPAR_BIND_CORES=1, or torchpar.bind_cores() once the group runs: each local rank, every one of its threads
    (Gloo's and the store's included), on its share of this host's CPUs, one intra-op thread per physical core."""
    script = tmp_path / "bound.py"
    script.write_text(BOUND_REPORT)
    result = torchrun("--nproc-per-node=2", f"--master-port={free_port}", script, **how)
    assert result.returncode == 0, result.stderr
    reports = sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
                     key=lambda report: report["rank"])
    assert [report["rank"] for report in reports] == [0, 1], result.stdout
    available = os.sched_getaffinity(0)
    for report in reports:
        assert report["sum"] == [2.0] * 4
        assert report["cpus"] and set(report["cpus"]) <= available
        assert report["intra_op"] == report["physical_cores"]
        for thread, allowed in report["threads"].items():
            assert cpu_list(allowed) == set(report["cpus"]), (thread, allowed, report["cpus"])
    if physical_cores_available() >= 2:  # else both are left unpinned
        assert not set(reports[0]["cpus"]) & set(reports[1]["cpus"])


def test_cpp_binary_binds_its_ranks_too(cpp_demo, free_port):
    result = torchrun("--nproc-per-node=2", f"--master-port={free_port}", "--no-python", cpp_demo,
                      TORCHPAR_BIND_CORES="1", TORCH_CPP_LOG_LEVEL="INFO")
    assert result.returncode == 0, result.stderr
    check_results(result.stdout, 2)
    if physical_cores_available() >= 2:
        assert "local rank 0 of 2 bound to CPUs" in result.stderr and "local rank 1 of 2 bound to CPUs" in result.stderr
    else:  # a host with one physical core (SMT siblings, or one CPU) leaves two ranks to the scheduler, and says so
        assert "2 local ranks on fewer physical cores: left unpinned" in result.stderr, result.stderr
