"""Subprocesses that cannot see some installed modules, as on a platform those have no wheel for.

`hiding_env(modules, directory)` is the environment for such a subprocess: PYTHONPATH starts with `directory`,
where a sitecustomize.py (run by `site` at every interpreter start) swaps the import system's path finder for one
that finds none of `modules`. There, `import m` raises ModuleNotFoundError and importlib.util.find_spec(m) is
None, exactly as when m is not installed, in the process and in every process it starts (the server's engine
process inherits the environment). The test interpreter itself is untouched.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_SITECUSTOMIZE = '''\
"""Written by tests/_hidden_modules.py: hides {modules!r} from this interpreter."""
import sys
from importlib.machinery import PathFinder

HIDDEN = {modules!r}


class _HidingPathFinder(PathFinder):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] in HIDDEN:
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[sys.meta_path.index(PathFinder)] = _HidingPathFinder
'''


def hiding_env(modules: tuple[str, ...], directory: Path) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(modules=tuple(modules)))
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(directory) + (os.pathsep + path if path else "")}


def check_hidden(env: dict[str, str], modules: tuple[str, ...]) -> None:
    """Asserts that an interpreter started with `env` finds none of `modules` and imports none of them."""
    code = ("import importlib, importlib.util, sys\n"
            "for m in sys.argv[1:]:\n"
            "    assert importlib.util.find_spec(m) is None, m\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except ModuleNotFoundError:\n"
            "        continue\n"
            "    raise AssertionError(m + ' imported')\n")
    proc = subprocess.run([sys.executable, "-c", code, *modules], env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
