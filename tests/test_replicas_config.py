"""`serve --replicas N` settings without starting anything: the flag and its alias, the workers'
flags rebuilt from the config (flags.config_argv), threads per worker, GPUs per worker, bad values."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from radixserve.frontend import preflight, replicas
from radixserve.frontend.cli import build_parser
from radixserve.frontend.flags import config_argv, config_from_args
from radixserve.frontend.config import ServerConfig
from radixserve.frontend.thinking_signature import KEY_ENV


def parse(*argv: str) -> ServerConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_replicas_flag_and_dp_size_alias():
    assert parse("--replicas", "3").replicas == 3 and parse("--dp-size", "2").replicas == 2
    assert parse().replicas == 1 and parse().router_policy == "cache_aware"
    assert parse("--router-policy", "manual").router_policy == "manual"


def test_config_argv_rebuilds_the_config():
    config = parse("--model", "/ckpt", "--page-size", "4", "--policy-window", "8", "--api-key", "k",
                   "--disable-log-requests", "--graceful-timeout", "12.5", "--replicas", "2")
    assert parse(*config_argv(config)) == config
    assert config_argv(ServerConfig()) == []  # defaults are not named


def test_workers_get_the_config_on_loopback_and_a_share_of_the_cores():
    config = parse("--model", "/ckpt", "--host", "0.0.0.0", "--port", "8000", "--replicas", "2",
                   "--page-size", "4")
    argv = replicas.worker_argv(config, gpus=0)
    worker = parse(*argv)
    assert worker.replicas == 1 and worker.host == "127.0.0.1" and worker.port == 0
    assert worker.engine.page_size == 4 and worker.model == "/ckpt"
    cores = config.engine.resolved_num_threads()
    assert worker.engine.num_threads == max(1, cores // 2)
    pinned = parse(*replicas.worker_argv(dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, num_threads=3)), gpus=0))
    assert pinned.engine.num_threads == 3  # an explicit --num-threads wins
    assert parse(*replicas.worker_argv(config, gpus=2)).engine.num_threads is None  # GPUs: no CPU split
    # A worker never closes an idle connection the router may still reuse (its pool keeps them 50 s).
    assert worker.keep_alive_s > 50 and config.keep_alive_s == 5
    longer = parse(*replicas.worker_argv(dataclasses.replace(config, keep_alive_s=120.0), gpus=0))
    assert longer.keep_alive_s == 120.0


def test_workers_share_one_thinking_key(monkeypatch):
    """A thinking block one worker signed must verify on whichever worker the next turn reaches."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    keys = {e[KEY_ENV] for e in replicas.worker_envs(parse("--replicas", "3"), 0)}
    assert len(keys) == 1 and len(keys.pop()) == 64
    monkeypatch.setenv(KEY_ENV, "shared-secret")
    assert {e[KEY_ENV] for e in replicas.worker_envs(parse("--replicas", "2"), 0)} == {"shared-secret"}


def test_one_gpu_per_worker(monkeypatch):
    config = parse("--replicas", "2")
    monkeypatch.setattr(preflight, "cuda_device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert replicas.num_gpus(config) == 2
    assert [e["CUDA_VISIBLE_DEVICES"] for e in replicas.worker_envs(config, 2)] == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert [e["CUDA_VISIBLE_DEVICES"] for e in replicas.worker_envs(config, 2)] == ["5", "7"]
    monkeypatch.setattr(preflight, "cuda_device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs one GPU per worker and 1 are visible"):
        replicas.num_gpus(config)
    monkeypatch.setattr(preflight, "cuda_device_count", lambda: 0)
    assert replicas.num_gpus(config) == 0  # no GPU at all: the CPU
    with pytest.raises(ValueError, match="pins one GPU"):
        replicas.num_gpus(parse("--replicas", "2", "--device", "cuda:1"))
    assert replicas.num_gpus(parse("--replicas", "2", "--device", "cpu")) == 0


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["--replicas", "2", "--model", "/no/such/ckpt"], "no such directory"),  # before any worker starts
])
def test_bad_replica_settings_fail_in_one_line(args, message):
    r = subprocess.run([sys.executable, "-m", "radixserve.frontend.cli", "serve", "--port", "0", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_workers_share_one_response_store_file(tmp_path):
    sup = replicas.Supervisor(parse("--replicas", "2", "--device", "cpu"))
    stores = [parse(*w.argv).response_store for w in sup.workers]
    assert stores[0] == stores[1] and stores[0].endswith("responses.sqlite")
    store_dir = os.path.dirname(stores[0])
    assert os.path.isdir(store_dir)
    sup.shutdown()  # nothing started: only the temporary store goes
    assert not os.path.exists(store_dir)
    given = str(tmp_path / "shared.sqlite")
    sup = replicas.Supervisor(parse("--replicas", "2", "--device", "cpu", "--response-store", given))
    assert {parse(*w.argv).response_store for w in sup.workers} == {given}
    sup.shutdown()
    assert tmp_path.exists()


def test_without_sglang_router_installed_the_error_names_the_extra(monkeypatch):
    import importlib.util

    from radixserve.frontend import router_proc

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "sglang_router" else real(name))
    with pytest.raises(ValueError, match=r"pip install 'radixserve\[router\]'"):
        router_proc.check_installed()
