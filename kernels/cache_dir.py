"""Where radixserve keeps what it builds once per machine (bench checkpoints, compiled kernels)."""
from __future__ import annotations

import os
import tempfile


def cache_root() -> str:
    """$RADIXSERVE_CACHE, else ~/.cache/radixserve (or a temp-dir fallback when home is not writable)."""
    root = os.environ.get("RADIXSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "radixserve")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError:
        root = os.path.join(tempfile.gettempdir(), f"radixserve-cache-{os.getuid()}")
        os.makedirs(root, exist_ok=True)
    return root
