"""Scheduling, requests and the Engine (ARCHITECTURE §2b, §5)."""
from .config import EngineConfig
from .req import GenerateResult, StreamDelta
from .sampling_params import SamplingParams


def __getattr__(name: str):
    # Engine pulls in torch and the model code; import it lazily so that SamplingParams
    # and friends stay light (the frontend and DSL import them in client processes).
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "EngineConfig", "GenerateResult", "SamplingParams", "StreamDelta"]
