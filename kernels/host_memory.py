"""Keep freed host memory in the process, so that each step's large activations reuse it.

glibc serves a block of at least its mmap threshold (at most 32 MiB) with a fresh mmap and
unmaps it on free, and trims the heap top once M_TRIM_THRESHOLD of it is free. A CPU forward
frees and re-allocates the same large activations every layer and every step (model M, a 4096-token
chunk: the [4096, 4096] fp32 gate/up output alone is 64 MiB), so every one of them is faulted in
page by page and zeroed by the kernel again. Measured (model M, gsp, 2 threads, bench/engine_ab.py):
880k minor page faults and 1.7 s of system time per run; with both thresholds raised, 16 and 0.07 s.

vLLM-CPU warns when tcmalloc is not preloaded for the same reason; this does it in-process with the
allocator already there: the memory a step freed stays mapped (the process keeps its peak heap)
and the next step's allocations are plain reuse. Other C libraries (musl, macOS) are left as they are.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap and are reused after free; larger ones (a vocab-wide logits
# block of a very long prompt) still get their own mapping, returned to the OS when freed.
MMAP_THRESHOLD_BYTES = 1 << 30
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # mallopt takes a C int: the largest, i.e. never trim


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where the C library is not
    glibc (nothing changed)."""
    libc = _glibc()
    if libc is None:
        return False
    done = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    logger.debug("glibc keeps freed host memory: %s", done)
    return done


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # only glibc has it (and its mallopt parameters)
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.mallopt.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None
