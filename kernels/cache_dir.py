"""Where radixserve keeps what it builds once per machine (bench checkpoints, compiled kernels).

The compiled kernels are code that gets loaded into the process, so the folders they are loaded
from must be private: created 0700, and before anything is loaded from them, owned by this user and
writable by no one else (``refusal``). A shared or planted folder (a predictable /tmp path, a
shared home, a container image's cache) is refused rather than trusted.
"""
from __future__ import annotations

import os
import stat
import tempfile


def cache_root() -> str:
    """$RADIXSERVE_CACHE, else ~/.cache/radixserve (or a per-user temp dir when home is not writable);
    created 0700 where it does not exist yet."""
    root = os.environ.get("RADIXSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "radixserve")
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
    except OSError:
        root = os.path.join(tempfile.gettempdir(), f"radixserve-cache-{os.getuid()}")
        os.makedirs(root, mode=0o700, exist_ok=True)
    return root


def refusal(path: str | os.PathLike) -> str | None:
    """Why code must not be loaded from ``path`` (a folder or a file), or None: it must belong to
    this user and be writable by no one else."""
    st = os.stat(path)
    if st.st_uid != os.getuid():
        return f"{os.fspath(path)} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{os.fspath(path)} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private_cache_dir(name: str) -> tuple[str, str | None]:
    """cache_root()/name, created 0700 where missing: (path, None) when it and the root pass
    ``refusal``, else (path, why not: nothing may be loaded from it). OSError when it cannot be created."""
    root = cache_root()
    folder = os.path.join(root, name)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return folder, refusal(root) or refusal(folder)
