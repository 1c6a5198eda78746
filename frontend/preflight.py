"""Checks that fail in one line before the model loads: device, attention backend, model path, port, and a
--context-length the KV pool cannot hold.

`radixserve serve` calls `check_before_load(config)` and `bind_listen_socket(host, port)` before it
starts the engine, so a wrong `--device`, `--attention-backend` or a busy port costs no model load
and prints `radixserve: error: <one line>` (exit status 2) instead of a traceback or a failure per
request. Both raise ConfigError (a ValueError).

The HTTP process never imports torch, so CUDA is asked of the driver itself: `libcuda`'s cuInit and
cuDeviceGetCount, in a short child process (initialising CUDA here would make a forked engine
process unable to use it). Without /dev/nvidia* (or WSL's /dev/dxg) there is no CUDA device and no
child is started. The engine's runner resolves `device=None` to cuda when a device is visible and
`attention_backend="auto"` to triton on CUDA, torch otherwise; this module decides the same way.
"""
from __future__ import annotations

import errno
import glob
import importlib.util
import os
import socket
import subprocess
import sys

from .config import ServerConfig
from .tenants import Tenants
from ..kernels.gguf_file import is_gguf_path
from ..kernels.model_config import load_model_config
from ..kernels.kv_budget import DEFAULT_CPU_KV_TOKENS, kv_pool_slots
from ..scheduler.config import EngineConfig, fit_context_to_pool

LISTEN_BACKLOG = 2048  # uvicorn's default
CUDA_PROBE_TIMEOUT_S = 60.0
_TRUE = ("1", "true", "on")  # what triton accepts for TRITON_INTERPRET

# Run with `python -I -S`: counts the CUDA devices the driver sees (CUDA_VISIBLE_DEVICES applies).
_CUDA_PROBE = """
import ctypes, sys
names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so", "libcuda.dylib")
for name in names:
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        continue
    count = ctypes.c_int(0)
    if lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0:
        print(count.value)
        sys.exit(0)
    break
print(0)
"""


class ConfigError(ValueError):
    """A setting that cannot work on this machine; the message is one line for the user."""


def check_before_load(config: ServerConfig) -> None:
    """Raise ConfigError for a model path, device or attention backend that cannot work here."""
    if config.model is not None:
        check_model_dir(config.model)
    if config.chat_template is not None and not os.path.isfile(config.chat_template):
        raise ConfigError(f"--chat-template {config.chat_template!r} is not a file (give a Jinja template file)")
    check_device_and_backend(config.engine)
    check_context_fits_pool(config)
    try:
        Tenants.from_config(config.api_key, config.api_keys)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_context_fits_pool(config: ServerConfig) -> None:
    """A --context-length the KV pool cannot hold one request of, refused before the model loads where the pool's
    size is known here (--kv-cache-tokens, or the CPU's default); the engine checks again once it has loaded."""
    engine = config.engine
    if engine.context_length is None:
        return  # the engine caps the model's context to the pool instead
    if engine.kv_cache_tokens is not None:
        pool = kv_pool_slots(engine.kv_cache_tokens, engine.page_size)
    elif engine.kv_cache_dtype != "auto":
        return  # its default pool is sized from the model's KV bytes (kv_budget.default_cpu_kv_tokens) at load
    elif engine.device == "cpu" or (engine.device is None and cuda_device_count() == 0):
        pool = kv_pool_slots(DEFAULT_CPU_KV_TOKENS, engine.page_size)
    else:
        return  # CUDA: the default pool is sized from the free memory, measured when the engine loads
    context = min(engine.context_length, _model_positions(config.model) or engine.context_length)
    try:
        fit_context_to_pool(context, pool, engine.page_size, context_set=True)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _model_positions(model: str | None) -> int | None:
    """The checkpoint's max_position_embeddings (the engine's context is at most that); None if unreadable
    (the engine then reports what is wrong with the checkpoint)."""
    from ..kernels.demo import DEMO_CHECKPOINT_DIR
    from ..kernels.model_config import load_model_config

    try:
        return load_model_config(model or DEMO_CHECKPOINT_DIR).max_position_embeddings
    except (ValueError, OSError, KeyError, TypeError):
        return None


def check_model_dir(model: str) -> None:
    """A local checkpoint directory or a GGUF file this engine loads, or a one-line reason: missing, another
    file, what looks like a hub id, or a GGUF file it cannot load: not GGUF, truncated, a tensor type or
    architecture it does not load (gguf_file.open_gguf), a config it does not support (parse_model_config)."""
    if os.path.isdir(model):
        return
    if is_gguf_path(model):
        if not os.path.isfile(model):
            raise ConfigError(f"--model {model!r}: no such GGUF file")
        try:
            load_model_config(model)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return
    if os.path.exists(model):
        raise ConfigError(f"--model {model!r} is a file; give the checkpoint directory that holds config.json, "
                          "or a .gguf file")
    owner, slash, name = model.partition("/")
    if slash and owner and name and "/" not in name and not model.startswith(".") and not os.path.isabs(model):
        raise ConfigError(f"--model {model!r} looks like a Hugging Face hub id, and there is no such local "
                          "directory: radixserve loads local checkpoints only (download it first, e.g. "
                          f"`hf download {model} --local-dir DIR`, then --model DIR)")
    raise ConfigError(f"--model {model!r}: no such directory (give a local checkpoint directory)")


def check_device_and_backend(engine: EngineConfig) -> None:
    device, backend = engine.device, engine.attention_backend
    if backend == "torch" and (device is None or device == "cpu"):
        return  # always available
    num_cuda = cuda_device_count()
    if device is not None and device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        if num_cuda == 0:
            raise ConfigError(f"--device {device}: no CUDA device is visible (no NVIDIA driver, or "
                              "CUDA_VISIBLE_DEVICES hides them); use --device cpu")
        if index >= num_cuda:
            raise ConfigError(f"--device {device}: only {num_cuda} CUDA device(s) are visible (cuda:0 to "
                              f"cuda:{num_cuda - 1})")
    on_cuda = device.startswith("cuda") if device is not None else num_cuda > 0
    if backend == "triton" or (backend == "auto" and on_cuda):
        _check_triton(backend, on_cuda)


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (SO_REUSEADDR, as uvicorn binds), for uvicorn's
    `server.run(sockets=[sock])`; ConfigError if the port is taken or the address unusable."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted connections only when it does,
    # and without it every small write of a reused connection waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ConfigError(_bind_error(host, port, exc)) from exc
    return sock


def cuda_device_count() -> int:
    """CUDA devices the NVIDIA driver reports to a fresh process (0 without a driver or a device)."""
    if sys.platform.startswith("linux") and not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg")):
        return 0
    try:
        out = subprocess.run([sys.executable, "-I", "-S", "-c", _CUDA_PROBE], capture_output=True, text=True,
                             timeout=CUDA_PROBE_TIMEOUT_S, check=False).stdout
        return int(out.split()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return 0


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


# -- helpers ----------------------------------------------------------------------------------


def _check_triton(backend: str, on_cuda: bool) -> None:
    if importlib.util.find_spec("triton") is None:
        why = "--attention-backend triton" if backend == "triton" else "--attention-backend auto picks triton on CUDA"
        raise ConfigError(f"{why}, but triton is not installed; pip install triton, or use --attention-backend torch")
    if not on_cuda and not triton_interpreted():
        raise ConfigError("--attention-backend triton needs a CUDA device, or TRITON_INTERPRET=1 in the "
                          "environment to run its kernels on the CPU (slowly); or use --attention-backend torch")


def _bind_error(host: str, port: int, exc: OSError) -> str:
    where = f"port {port} on {host}"
    if exc.errno == errno.EADDRINUSE:
        return f"{where} is in use (another server?); stop it or pick another --port (0: any free port)"
    if exc.errno == errno.EACCES:
        return f"no permission to listen on {where} (ports below 1024 need privileges); pick another --port"
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host!r}: not an address of this machine; check --host"
    return f"cannot listen on {where}: {exc.strerror or exc}"
