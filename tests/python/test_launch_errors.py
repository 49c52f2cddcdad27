"""A wrong launch gives one clear line naming what is wrong; never a hang."""
import datetime
import time

import pytest

import torchpar

TORCHRUN_VARIABLES = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHPAR_TIMEOUT",
                      "TORCHPAR_BACKEND", "TORCHPAR_BIND_CORES"]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_launch_error_is_a_runtime_error():
    assert issubclass(torchpar.LaunchError, RuntimeError)


def test_missing_variables_are_all_named(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(torchpar.LaunchError) as error:
        torchpar.init_process_group()
    message = str(error.value)
    assert "environment variables WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set" in message
    assert "torchrun" in message and "\n" not in message


def test_rank_beyond_world_size(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(torchpar.LaunchError, match=r"RANK=2 is out of range for WORLD_SIZE=2 \(valid ranks: 0..1\)"):
        torchpar.init_process_group()


def test_config_is_read_like_cpp(monkeypatch):
    for name, value in dict(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="h",
                            MASTER_PORT="1234", TORCHELASTIC_RESTART_COUNT="3").items():
        monkeypatch.setenv(name, value)
    config = torchpar.read_launch_config()
    assert (config.rank, config.world_size, config.local_rank, config.local_world_size) == (1, 4, 1, 2)
    assert (config.master_addr, config.master_port, config.restart_count) == ("h", 1234, 3)
    assert not config.use_agent_store


def test_unreachable_master_fails_within_the_timeout(monkeypatch, free_port):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port))
    start = time.monotonic()
    with pytest.raises(torchpar.LaunchError) as error:
        torchpar.init_process_group(timeout=datetime.timedelta(seconds=2))
    assert time.monotonic() - start < 30
    assert f"rank 1 could not reach the rendezvous store at 127.0.0.1:{free_port} within 2 s" in str(error.value)


def test_bad_timeout_variable(monkeypatch):
    monkeypatch.setenv("TORCHPAR_TIMEOUT", "soon")
    with pytest.raises(torchpar.LaunchError, match="TORCHPAR_TIMEOUT='soon' is not a positive number"):
        torchpar._C.resolve_timeout(None)
    monkeypatch.setenv("TORCHPAR_TIMEOUT", "2.5")
    assert torchpar._C.resolve_timeout(None) == datetime.timedelta(seconds=2.5)


def test_unknown_backend(monkeypatch):
    monkeypatch.setenv("TORCHPAR_BACKEND", "mpi")
    with pytest.raises(RuntimeError, match="unknown backend 'mpi'"):
        torchpar.init_process_group(rank=0, world_size=1, store=torchpar_store())


def torchpar_store():
    import torch.distributed as dist

    return dist.HashStore()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_nccl_without_gpu_says_so():
    with pytest.raises(RuntimeError, match="backend 'nccl'.*use backend 'gloo'"):
        torchpar.init_process_group(backend="nccl", rank=0, world_size=1, store=torchpar_store())


def test_binding_cores_outside_torchrun_names_what_is_missing(monkeypatch):
    with pytest.raises(torchpar.LaunchError, match="LOCAL_RANK is not set .*pass local_rank and local_world_size"):
        torchpar.bind_cores()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(torchpar.LaunchError, match="LOCAL_WORLD_SIZE='two' is not an integer"):
        torchpar.bind_cores()
    with pytest.raises(RuntimeError, match="local rank 3 is out of range for 2 local ranks"):
        torchpar.bind_cores(3, 2)
