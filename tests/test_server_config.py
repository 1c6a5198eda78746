"""Server configuration: flags generated from the config dataclasses, one wording for bad values,
PolicyConfig / reuse_bonus reaching the engine, and `radixserve serve` failing fast (exit 2, one
line, before the model loads) on a busy port, a missing CUDA device or an unusable backend."""
import dataclasses
import os
import socket
import subprocess
import sys
import time

import pytest

from _http_server import tiny_model_path
from radixserve.frontend.cli import build_parser
from radixserve.frontend.flags import config_flags, config_from_args
from radixserve.frontend.config import ServerConfig
from radixserve.frontend.preflight import ConfigError, bind_listen_socket, check_before_load
from radixserve.scheduler.checks import describe_range
from radixserve.scheduler.config import EngineConfig, PolicyConfig, fit_context_to_pool
from radixserve.scheduler.sampling_params import SamplingParams

FAIL_FAST_S = 20.0  # far below a model load in a fresh interpreter (torch import alone takes seconds)


def _flags() -> dict[str, str]:
    """flag -> help text of `radixserve serve`."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return {opt: action.help for action in serve._actions for opt in action.option_strings if opt.startswith("--")}


def test_every_engine_and_policy_field_is_a_flag_with_help():
    flags = _flags()
    for f in dataclasses.fields(EngineConfig):
        if f.name != "model_path":  # named once, by --model
            assert flags.get("--" + f.name.replace("_", "-")) or f.name == "policy", f.name
    for f in dataclasses.fields(PolicyConfig):
        assert flags["--policy-" + f.name.replace("_", "-")], f.name
    for name in ("--model", "--port", "--watchdog-timeout", "--disable-log-requests", "--graceful-timeout"):
        assert flags[name]
    assert all(help_text for help_text in flags.values())
    assert len({flag.dest for flag in config_flags()}) == len(config_flags())


def test_flags_build_the_nested_config():
    args = build_parser().parse_args(["serve", "--model", "/m", "--page-size", "4", "--policy-window", "8",
                                      "--policy-starvation-rule", "aging", "--reuse-bonus", "2.5",
                                      "--watchdog-timeout", "7", "--disable-log-requests"])
    cfg = config_from_args(args)
    assert cfg.engine == EngineConfig(model_path="/m", page_size=4, reuse_bonus=2.5,
                                      policy=PolicyConfig(window=8, starvation_rule="aging"))
    assert cfg.watchdog_timeout_s == 7.0 and cfg.disable_log_requests
    assert cfg.engine_kwargs()["policy"].window == 8 and "model_path" not in cfg.engine_kwargs()
    info = cfg.public_dict()
    assert info["page_size"] == 4 and info["policy"]["window"] == 8 and info["model"] == "/m"
    assert config_from_args(build_parser().parse_args(["serve"])) == ServerConfig()
    assert ServerConfig().watchdog_timeout_s == 300.0 and not ServerConfig().disable_log_requests


def test_model_is_named_once():
    assert ServerConfig(model="/m").engine.model_path == "/m"
    assert ServerConfig(model="/m", engine={"page_size": 2}).engine.page_size == 2
    with pytest.raises(ValueError, match="named twice"):
        ServerConfig(model="/m", engine=EngineConfig(model_path="/other"))


@pytest.mark.parametrize("make, message", [
    (lambda: EngineConfig(page_size=0), "page_size must be >= 1, got 0"),
    (lambda: EngineConfig(reuse_bonus=-1.0), "reuse_bonus must be >= 0, got -1"),
    (lambda: EngineConfig(dtype="fp8"), "dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"),
    (lambda: EngineConfig(device="gpu"), "device must be cpu, cuda or cuda:N, got 'gpu'"),
    (lambda: EngineConfig(policy={"window": 0}), "policy.window must be >= 1, got 0"),
    (lambda: ServerConfig(port=70000), "port must be between 0 and 65535, got 70000"),
    (lambda: ServerConfig(watchdog_timeout_s=0), "watchdog_timeout_s must be > 0, got 0"),
    (lambda: SamplingParams(temperature=150), "temperature must be between 0 and 100, got 150"),
    (lambda: SamplingParams(top_p=0.0), "top_p must be > 0 and <= 1, got 0"),
    (lambda: SamplingParams(max_new_tokens=-1), "max_new_tokens must be >= 0, got -1"),
])
def test_one_wording_for_bad_values(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == message


def test_describe_range():
    assert describe_range(1) == ">= 1" and describe_range(0, 2.0) == "between 0 and 2"
    assert describe_range(1, 1) == "1" and describe_range(0, 1, lo_open=True) == "> 0 and <= 1"
    assert describe_range(hi=5) == "<= 5" and describe_range(0.5) == ">= 0.5"


def test_engine_takes_policy_and_reuse_bonus_from_its_config():
    from radixserve.scheduler import Engine

    engine = Engine(tiny_model_path(), num_threads=1, kv_cache_tokens=256, reuse_bonus=3.0,
                    policy={"window": 8, "starvation_rule": "none"})
    try:
        assert engine.policy.config == PolicyConfig(window=8, starvation_rule="none")
        assert engine.kv.tree.reuse_bonus == 3.0
    finally:
        engine.shutdown()


# -- preflight ---------------------------------------------------------------------------------


def test_preflight_in_process():
    check_before_load(ServerConfig())  # the demo model, torch on the CPU: nothing to refuse
    with pytest.raises(ConfigError, match="no such directory"):
        check_before_load(ServerConfig(model="/no/such/checkpoint"))
    with pytest.raises(ConfigError, match="looks like a Hugging Face hub id.*`hf download Qwen/Qwen2.5-0.5B-Instruct "):
        check_before_load(ServerConfig(model="Qwen/Qwen2.5-0.5B-Instruct"))
    with pytest.raises(ConfigError, match="is a file"):
        check_before_load(ServerConfig(model=__file__))
    with pytest.raises(ConfigError, match="--chat-template .* is not a file"):
        check_before_load(ServerConfig(chat_template="/no/such/template.jinja"))
    sock = bind_listen_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is in use"):
            bind_listen_socket("127.0.0.1", port)
    finally:
        sock.close()


def test_preflight_does_not_import_torch():
    code = """
import sys
from radixserve.frontend import cli, preflight
from radixserve.frontend.config import ServerConfig
for engine in ({"device": "cuda"}, {"attention_backend": "triton"}, {}):
    try:
        preflight.check_before_load(ServerConfig(engine=engine))
    except preflight.ConfigError:
        pass
preflight.bind_listen_socket("127.0.0.1", 0).close()
assert "torch" not in sys.modules, "torch imported"
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _serve(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "radixserve.frontend.cli", "serve", "--model", tiny_model_path(),
           "--num-threads", "1", "--kv-cache-tokens", "1024", "--log-level", "info", *args]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    return out, time.monotonic() - t0


def _assert_failed_fast(out: subprocess.CompletedProcess, elapsed: float, *fragments: str) -> None:
    lines = out.stderr.splitlines()
    # One line and nothing else: at --log-level info a model load logs (loader, runner, engine).
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("radixserve: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines
    assert elapsed < FAIL_FAST_S, elapsed


def test_busy_port_fails_before_the_model_loads():
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out, elapsed = _serve("--host", "127.0.0.1", "--port", str(port))
    _assert_failed_fast(out, elapsed, f"port {port} on 127.0.0.1 is in use")


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has a CUDA driver")
def test_cuda_device_without_cuda_fails_before_the_model_loads():
    out, elapsed = _serve("--port", "0", "--device", "cuda")
    _assert_failed_fast(out, elapsed, "--device cuda", "no CUDA device")


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has a CUDA driver")
def test_triton_without_cuda_or_interpreter_fails_before_the_model_loads():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out, elapsed = _serve("--port", "0", "--attention-backend", "triton", env=env)
    _assert_failed_fast(out, elapsed, "--attention-backend triton", "TRITON_INTERPRET=1")


def test_bad_flag_value_is_one_line_naming_the_flag():
    out, elapsed = _serve("--port", "0", "--policy-overtake-ratio", "-1")
    _assert_failed_fast(out, elapsed, "--policy-overtake-ratio must be >= 0, got -1")


def test_context_the_kv_pool_cannot_hold_is_refused_before_the_model_loads():
    out, elapsed = _serve("--port", "0", "--context-length", "1000", "--kv-cache-tokens", "10")
    _assert_failed_fast(out, elapsed, "--context-length 1000 needs a KV cache of 1000 token slots",
                        "raise --kv-cache-tokens to 1000 or more, or lower --context-length to 10")


def test_preflight_context_against_the_pool():
    tiny = tiny_model_path()  # 1024 positions
    with pytest.raises(ConfigError, match="context_length 1000 needs a KV cache of 1008 .* lower context_length to 96"):
        check_before_load(ServerConfig(model=tiny, engine={"context_length": 1000, "kv_cache_tokens": 100,
                                                           "page_size": 16}))
    with pytest.raises(ConfigError, match="context_length 1024 needs"):  # the model's positions bound the context
        check_before_load(ServerConfig(model=tiny, engine={"context_length": 100_000, "kv_cache_tokens": 1000}))
    check_before_load(ServerConfig(model=tiny, engine={"context_length": 100_000, "kv_cache_tokens": 1024}))
    check_before_load(ServerConfig(model=tiny, engine={"kv_cache_tokens": 10}))  # no --context-length: capped later
    # The demo model (4096 positions) with the CPU's default pool (16,384 slots).
    check_before_load(ServerConfig(engine={"context_length": 100_000, "device": "cpu"}))


def test_fit_context_to_pool():
    assert fit_context_to_pool(4096, 16384, 1, context_set=True) == 4096
    assert fit_context_to_pool(32768, 16384, 1, context_set=False) == 16384  # the model's own: capped
    assert fit_context_to_pool(16384, 16384, 1, context_set=True) == 16384
    with pytest.raises(ValueError, match="needs a KV cache of 48 token slots .* and it has 32"):
        fit_context_to_pool(33, 32, 16, context_set=True)


def test_engine_refuses_a_context_its_pool_cannot_hold():
    from radixserve.scheduler import Engine

    with pytest.raises(ValueError, match="context_length 500 needs a KV cache of 500 token slots"):
        Engine(tiny_model_path(), num_threads=1, kv_cache_tokens=100, context_length=500)
    engine = Engine(tiny_model_path(), num_threads=1, kv_cache_tokens=100)
    try:
        assert engine.context_length == 100  # the model's 1024, capped to the pool
        with pytest.raises(ValueError, match="the prompt has 90 tokens and max_new_tokens is 20: 110 exceeds the "
                                             "context length 100"):
            engine.add_request(list(range(90)), {"max_new_tokens": 20})
    finally:
        engine.shutdown()


def test_listen_socket_gives_accepted_connections_tcp_nodelay():
    """A reused keep-alive connection must not wait for delayed ACKs (Nagle): asyncio turns
    TCP_NODELAY on for accepted connections only if the listening socket says IPPROTO_TCP."""
    import asyncio
    import socket

    from radixserve.frontend.preflight import bind_listen_socket

    async def accepted_nodelay() -> int:
        sock = bind_listen_socket("127.0.0.1", 0)
        flags = []

        async def on_connect(reader, writer):
            flags.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):
            if flags:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        return flags[0]

    assert asyncio.run(accepted_nodelay()) != 0
