"""Model side of radixserve: checkpoint loading, the Llama-family forward, sampling, the KV pool.

The scheduler talks to this package only through ``ModelRunner.forward(list[SeqInput])``.
"""
from radixserve.kernels.forward_io import SeqInput, SeqOutput, TokenLogprob
from radixserve.kernels.model_config import ModelConfig, RopeConfig, load_model_config
from radixserve.kernels.runner import ForwardInput, ModelRunner

__all__ = [
    "ForwardInput",
    "ModelConfig",
    "ModelRunner",
    "RopeConfig",
    "SeqInput",
    "SeqOutput",
    "TokenLogprob",
    "load_model_config",
]
