"""Fixtures that run the native kernel's tests on every build this CPU can run (each forced through
$RADIXSERVE_NATIVE_ISA; the portable one always) and, for attention, on every element type and
product path of each build: fp32; bf16 widened to fp32 (every build); bf16 with vdpbf16ps (the AVX-512
build, where the CPU has AVX512-BF16); bf16 on AMX tiles (the AVX-512 build, where the CPU has
AMX-BF16). Only where nothing can be built (not Linux, no C compiler) are there no cases; a build that
fails fails the tests.

Tolerances: bf16 inputs are exact in float64 and the kernel sums in fp32 and writes fp32, so its
error is fp32 accumulation, plus on AMX and vdpbf16ps the rounding of the probabilities to bf16 for
P V: each p off by at most 2^-8 relative, so the output by at most 2^-8 * sum_j p_j |v_j|
(``p_rounding``).
"""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from radixserve.kernels import native

NEEDS_NATIVE = pytest.mark.skipif(native.cannot_build() is not None, reason=f"{native.cannot_build()}")


def _paths(isa: str) -> list[str]:
    flags = set(native.this_cpu_flags())
    dp = isa == "avx512" and "avx512_bf16" in flags
    amx = dp and {"amx_bf16", "amx_tile"} <= flags
    return ["float32", "bfloat16", *(["bfloat16-dp"] if dp else []), *(["bfloat16-amx"] if amx else [])]


def p_rounding(dtype: torch.dtype) -> float:
    """The relative error of the probabilities in P V under the reader in use: 2^-8 on AMX tiles or
    vdpbf16ps, else 0."""
    return 2.0 ** -8 if dtype == torch.bfloat16 and native._products(True) else 0.0


READERS = [(isa, path) for isa in native.runnable_isas() for path in _paths(isa)]


@contextlib.contextmanager
def _forced(isa: str):
    """The build for isa loaded (and forgotten afterwards); yields a MonkeyPatch undone before that."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native.ISA_ENV, isa)
        native.reset()
        assert native.status() == f"native {isa}"
        yield mp
    native.reset()


@pytest.fixture(scope="module", params=native.runnable_isas())
def isa(request):
    """The kernel built for one instruction set, forced for the tests that take it."""
    with _forced(request.param):
        yield request.param


@pytest.fixture(scope="module", params=READERS, ids=["-".join(r) for r in READERS])
def reader(request) -> torch.dtype:
    """One build and one attention path of it; gives the dtype of q, K and V."""
    isa_name, path = request.param
    with _forced(isa_name) as mp:
        if path in ("bfloat16", "bfloat16-dp"):  # no AMX tiles, also where the CPU has them
            mp.setattr(native, "_use_amx", functools.lru_cache(maxsize=1)(lambda: False))
        if path == "bfloat16":  # widened, also where vdpbf16ps would be used (cached, as native.reset needs)
            mp.setattr(native, "_use_dpbf16", functools.lru_cache(maxsize=1)(lambda: False))
        products = {"float32": 0, "bfloat16": 0, "bfloat16-dp": 2, "bfloat16-amx": 1}[path]
        assert native._products(path != "float32") == products
        yield torch.float32 if path == "float32" else torch.bfloat16
