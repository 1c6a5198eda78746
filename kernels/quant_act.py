"""int8 activations for quantized linears at decode (cpu_quant_i8.c, called by quant_linear.linear_int8): llama.cpp's
arithmetic on its own files; this module holds the rules (which calls, where, the activations' definition).

A decode step's rows (at most ``MAX_ROWS[kind]``) are quantized to int8 per block of 32 inputs (16 where the
weight's group is not a multiple of 32) and multiply the packed weight's integer values in integer dot products
(AVX2's vpmaddubsw / vpmaddwd), each block's sums scaled in fp32: ``quantize_activations`` is the definition, and
the result equals ``F.linear(quantize_activations(x, block), dequantize(W))`` up to the order of the fp32 sums.
Against the exact kernels (weight-only: the activations in the model's dtype) it trades at most half a step of the
block's int8 grid per input (``max |x| / 254``) for speed: a single row of int4 reads its weight ~4x faster than the
fp32 kernel, which is what single-stream decode of a 4-bit GGUF file on an AVX2 CPU waits on
(bench/results/gguf_int8_act_avx2_s49.md). Prefill (more rows) stays exact.

The setting (``EngineConfig.quantized_activations``, ``--quantized-activations``): "none" keeps weight-only
quantization everywhere; "int8" quantizes decode activations for every quantized weight; "auto" (the default) does
it for a GGUF file's weights where the quantized kernel would be the fp32 one (quant_linear.kernel: CPUs without
AVX512-BF16, or --dtype float32), as llama.cpp computes those files, and keeps weight-only quantization elsewhere
(--quantization of a float checkpoint, and the bf16 kernels, which were not measured against this one).
"""
from __future__ import annotations

import platform

import torch

from .loader import cpu_flags
from .quant_spec import QUANTIZED_ACTIVATIONS as CHOICES

MAX_ROWS = {"int4": 16, "int8": 2}  # at more rows the exact kernels were as fast (int8 values from 3-4 rows on)
NEEDS = ("avx2", "fma", "f16c")


def block_for(group: int) -> int:
    """Inputs per activation block for a weight quantized in groups of `group`: 32, or 16 where 32 does not
    divide the group (a block never straddles two groups)."""
    return 32 if group % 32 == 0 else 16


def quantize_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [M, K] as the kernel sees it, in float32: per block of `block` inputs d = max |x| / 127 and
    x^ = d * round(x / d) (ties to even; a block of zeros stays zero)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    d = xb.abs().amax(dim=2) / 127.0
    safe = torch.where(d > 0, d, 1.0)[..., None]
    return (torch.round(xb / safe) * d[..., None]).reshape(m, k)


def ready() -> bool:
    """Whether the int8 kernel runs here: the native library on x86-64 with AVX2, FMA and F16C."""
    from . import native

    return platform.machine() in ("x86_64", "AMD64") and set(NEEDS) <= set(cpu_flags()) and native.load() is not None


def resolve(setting: str, gguf: bool, exact_kernel: str | None, device: torch.device) -> bool:
    """Whether the model's quantized linears take int8 activations at decode (the module docstring), given the
    exact kernel its weights would run on (quant_linear.kernel(dtype)); ValueError for "int8" where the kernel cannot run."""
    if setting not in CHOICES:
        raise ValueError(f"quantized_activations must be one of {', '.join(CHOICES)}, got {setting!r}")
    if setting == "none":
        return False
    runs = device.type == "cpu" and ready()
    if setting == "int8" and not runs:
        raise ValueError(f"quantized_activations int8 needs the native kernels on an x86-64 CPU with "
                         f"{', '.join(NEEDS)} (this is {device.type}, {platform.machine()}): use none")
    return runs and (setting == "int8" or (gguf and exact_kernel == "fp32"))
