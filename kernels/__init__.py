"""Model side of radixserve: checkpoint loading, the Llama-family forward, sampling, the KV pool.

The scheduler talks to this package only through ``ModelRunner.forward(list[SeqInput])``.

The exports load lazily: ``forward_io`` (the dataclasses requests carry) and ``model_config`` are torch-free, and
importing them through this package must not pull in torch (the HTTP process imports them and never runs a model);
``ModelRunner``/``ForwardInput`` import torch on first access.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ForwardInput": "radixserve.kernels.runner",
    "ModelRunner": "radixserve.kernels.runner",
    "ModelConfig": "radixserve.kernels.model_config",
    "RopeConfig": "radixserve.kernels.model_config",
    "load_model_config": "radixserve.kernels.model_config",
    "SeqInput": "radixserve.kernels.forward_io",
    "SeqOutput": "radixserve.kernels.forward_io",
    "TokenLogprob": "radixserve.kernels.forward_io",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted(_EXPORTS)
