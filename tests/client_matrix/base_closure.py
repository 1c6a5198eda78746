"""Run with the base venv's python: which installed distributions radixserve's base requirements do not reach
(through every Requires-Dist, markers evaluated, none of radixserve's extras), and which they need but are missing.
Prints {"unreached": [...], "missing": [...]} as one JSON line."""
from __future__ import annotations

import json
from importlib import metadata

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

VENV_OWN = {"pip", "setuptools", "wheel"}  # what `python -m venv` installs


def main() -> None:
    installed = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions()}
    seen: set[tuple[str, str]] = set()
    missing: set[str] = set()
    todo = [("radixserve", "")]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        if name not in installed:
            missing.add(name)
            continue
        for text in installed[name].requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                dep = canonicalize_name(req.name)
                todo += [(dep, ""), *((dep, e) for e in req.extras)]
    reached = {name for name, _ in seen}
    print(json.dumps({"unreached": sorted(set(installed) - reached - VENV_OWN), "missing": sorted(missing)}))


if __name__ == "__main__":
    main()
