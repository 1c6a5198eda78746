"""Scheduling, requests and the Engine (ARCHITECTURE §2b, §4)."""
from radixserve.scheduler.config import EngineConfig
from radixserve.scheduler.req import GenerateResult, StreamDelta
from radixserve.scheduler.sampling_params import SamplingParams


def __getattr__(name: str):
    # Engine pulls in torch and the model code; import it lazily so that SamplingParams
    # and friends stay light (the frontend and DSL import them in client processes).
    if name == "Engine":
        from radixserve.scheduler.engine import Engine
        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "EngineConfig", "GenerateResult", "SamplingParams", "StreamDelta"]
