"""Cached virtual environments for tests that run code outside the test environment (tests/test_client_matrix.py).

`client_python(name)` is the interpreter of a client-only venv: one HTTP client library at pinned versions and
no torch (the clients' pins conflict when they share one environment). `base_python()` is the interpreter of a
venv holding radixserve installed editable with its base dependencies only, no extras: what a user gets from the
README's `pip install torch==2.13.0 && pip install -e .`.

Each venv is built once under VENV_ROOT (outside the repository: $RADIXSERVE_TEST_VENVS, by default
~/.cache/radixserve-test-venvs), in a directory named by a hash of what it installs, so changing a pin or
pyproject's dependencies builds a new one and later runs on the same machine reuse it. A file lock makes concurrent
test processes wait for one build. A build that fails (no access to the package index, say) raises with pip's
output: these tests fail rather than skip.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_ROOT = Path(os.environ.get("RADIXSERVE_TEST_VENVS") or Path.home() / ".cache" / "radixserve-test-venvs")
TORCH_PIN = "torch==2.13.0"  # the README's install line (CI's torch)
BUILD_TIMEOUT_S = 1800.0
STALE_S = 86400.0  # a cached venv unused this long is removed once a newer one of its kind is built

# One venv per client, each pinned to a current release (`pip index versions NAME`); the clients' own
# dependencies resolve freely inside their venv.
CLIENT_REQUIREMENTS: dict[str, tuple[str, ...]] = {
    "openai": ("openai==3.57.0",),
    "pydantic_ai": ("pydantic-ai-slim[openai]==2.68.0",),
    "instructor": ("instructor==1.17.0", "openai==3.3.0"),  # instructor caps jiter below what later openai needs
    "litellm": ("litellm==1.110.2",),
}
# Modules that only radixserve's extras (or the test environment) provide: none may import in the base venv.
# (triton is an extra too, but xgrammar requires it on Linux x86-64, so the base install has it there.)
EXTRAS_ONLY_MODULES = ("openai", "sglang_router", "pytest", "hypothesis", "matplotlib", "kubernetes_validate")
# Environment of every process run with a cached venv's interpreter: nothing from this test environment leaks in.
ISOLATED_ENV = {"PYTHONPATH": "", "PYTHONNOUSERSITE": "1", "VIRTUAL_ENV": ""}


def client_python(name: str) -> str:
    """The interpreter of `name`'s client-only venv (built on first use)."""
    pins = CLIENT_REQUIREMENTS[name]
    return _cached_venv(f"client-{name}", [list(pins)], key_extra={})


def base_python() -> str:
    """The interpreter of a venv with `pip install torch==2.13.0 && pip install -e REPO` (no extras)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    # What the editable install depends on: the base dependencies, and the package layout (an editable
    # install maps the packages listed here; a package added later needs a new install). Not the extras, nor
    # package data (read from the source tree).
    setuptools = project.get("tool", {}).get("setuptools", {})
    key = {"dependencies": project["project"]["dependencies"], "scripts": project["project"].get("scripts"),
           "packages": setuptools.get("packages"), "package-dir": setuptools.get("package-dir"), "repo": str(REPO)}
    return _cached_venv("server-base", [[TORCH_PIN], ["-e", str(REPO)]], key_extra=key)


def importable(python: str, modules: tuple[str, ...]) -> list[str]:
    """Those of `modules` that `python` can import (found on its path; nothing is imported)."""
    code = ("import importlib.util, json, sys; "
            "print(json.dumps([m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None]))")
    out = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True, check=True,
                         env=dict(os.environ, **ISOLATED_ENV), cwd=VENV_ROOT)
    return json.loads(out.stdout)


def run_script(python: str, script: Path, *args: str, timeout: float = 180.0) -> dict:
    """Run `script` with `python` (isolated from this environment); its last stdout line is its JSON report."""
    env = dict(os.environ, **ISOLATED_ENV, LITELLM_LOCAL_MODEL_COST_MAP="True", OPENAI_API_KEY="unused")
    proc = subprocess.run([python, str(script), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=script.parent)
    if proc.returncode != 0:
        raise AssertionError(f"{script.name} exited with {proc.returncode}:\n{proc.stderr[-6000:]}\n"
                             f"{proc.stdout[-2000:]}")
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise AssertionError(f"{script.name} printed no report:\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------------------------------------


def _cached_venv(name: str, installs: list[list[str]], key_extra: dict) -> str:
    """A venv at VENV_ROOT/<name>-<hash>, built with one `pip install` per entry of `installs` unless a complete
    one is there; returns its interpreter."""
    fingerprint = json.dumps({"python": sys.version_info[:2], "installs": installs, **key_extra}, sort_keys=True)
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    target = VENV_ROOT / f"{name}-{digest}"
    python = target / "bin" / "python"
    marker = target / ".complete"
    VENV_ROOT.mkdir(parents=True, exist_ok=True)
    with open(VENV_ROOT / f"{name}-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process building the same venv: wait for it
        if not marker.exists():
            shutil.rmtree(target, ignore_errors=True)  # an interrupted build
            try:
                _build(target, installs)
            except BaseException:
                shutil.rmtree(target, ignore_errors=True)
                raise
            marker.write_text(fingerprint)
            _prune(name, keep=target)
        marker.touch()  # last use, for _prune
    return str(python)


def _prune(name: str, keep: Path) -> None:
    """Remove the venvs of `name` unused for STALE_S (each change of pins or dependencies leaves one behind;
    the base venv is ~2 GB). Unfinished ones are left to the build that owns them."""
    for old in VENV_ROOT.glob(f"{name}-*/.complete"):
        if old.parent != keep and time.time() - old.stat().st_mtime > STALE_S:
            shutil.rmtree(old.parent, ignore_errors=True)
            old.parent.with_suffix(".lock").unlink(missing_ok=True)


def _build(target: Path, installs: list[list[str]]) -> None:
    start = time.monotonic()
    _check_call([sys.executable, "-m", "venv", str(target)], f"create the venv {target}")
    for args in installs:
        _check_call([str(target / "bin" / "python"), "-m", "pip", "install", "--quiet", *args],
                    f"pip install {' '.join(args)} into {target}")
    print(f"built {target} in {time.monotonic() - start:.0f} s", file=sys.stderr)


def _check_call(cmd: list[str], what: str) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                              env=dict(os.environ, **ISOLATED_ENV), cwd=VENV_ROOT)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"could not {what}: no result after {BUILD_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"could not {what} (these tests need the package index to build their venvs once; "
                           f"they are cached under {VENV_ROOT} afterwards):\n{proc.stderr[-4000:]}")
