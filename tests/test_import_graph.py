"""The layering, read from the imports: every module of every top-level folder, parsed (not imported), with each
import resolved to the module it names. Fails on an import against the layering or on an import cycle."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What each folder may import besides itself, written down once. radix and kernels are the bottom (radix: ints only;
# kernels: the model), the scheduler drives both, the HTTP frontend drives the scheduler, the DSL (lang) is a client
# of the scheduler's Engine or the HTTP server and may use radix's pure accounting, bench sits on top of everything.
LAYERS: dict[str, frozenset[str]] = {
    "radix": frozenset(),
    "kernels": frozenset(),
    "scheduler": frozenset({"radix", "kernels"}),
    "frontend": frozenset({"radix", "kernels", "scheduler"}),
    "lang": frozenset({"radix", "scheduler", "frontend"}),
    "bench": frozenset({"radix", "kernels", "scheduler", "frontend", "lang"}),
}


def module_files() -> dict[str, Path]:
    """Dotted name (radixserve.<folder>...) -> file, for every .py file under the package folders."""
    out = {}
    for folder in LAYERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(("radixserve", *parts))] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str, path: Path, known: set[str]) -> list[tuple[str, int, str]]:
    """(imported radixserve module, line, when) for each import in the file, `when` being "load" (runs as the
    module loads), "call" (inside a function) or "typing" (under `if TYPE_CHECKING`: never runs). `from pkg import
    name` counts pkg.name where that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, when: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = when
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = "typing"
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and when == "load":
                inner = "call"
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, when) for a in child.names if a.name.startswith("radixserve."))
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(module, path.name == "__init__.py", child)
                if target.startswith("radixserve."):
                    subs = [f"{target}.{a.name}" for a in child.names if f"{target}.{a.name}" in known]
                    found.extend((t, child.lineno, when) for t in subs or [target])
            visit(child, inner)

    visit(tree, "load")
    return found


def folder(module: str) -> str:
    return module.split(".")[1]


GRAPH_FILES = module_files()
GRAPH = {mod: imports(mod, path, set(GRAPH_FILES)) for mod, path in GRAPH_FILES.items()}


def test_every_import_names_a_module_that_exists():
    known = set(GRAPH)
    missing = [f"{mod}:{line} -> {target}" for mod, edges in GRAPH.items() for target, line, _ in edges
               if target not in known and target.rsplit(".", 1)[0] not in known]
    assert not missing, missing


def test_no_import_against_the_layering():
    upward = [f"{GRAPH_FILES[mod]}:{line} imports {target}" for mod, edges in GRAPH.items()
              for target, line, _ in edges
              if folder(target) != folder(mod) and folder(target) not in LAYERS[folder(mod)]]
    assert not upward, "\n".join(upward)


def test_folders_import_each_other_with_relative_imports():
    absolute = []
    for mod, path in GRAPH_FILES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("radixserve"):
                absolute.append(f"{path}:{node.lineno}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("radixserve") for a in node.names):
                absolute.append(f"{path}:{node.lineno}")
    assert not absolute, absolute


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or of one that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def _module_of(target: str) -> str:
    return target if target in GRAPH else target.rsplit(".", 1)[0]


def test_no_import_cycle():
    """No cycle among the imports that run, whether as a module loads or inside a function (a function-level import
    is a dependency too; it only runs later). Imports for type annotations alone (TYPE_CHECKING) never run."""
    edges = {mod: {_module_of(t) for t, _, when in found if when != "typing"} - {mod} for mod, found in GRAPH.items()}
    assert not _cycles(edges), _cycles(edges)


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path):
    (tmp_path / "kernels").mkdir()
    bad = tmp_path / "kernels" / "bad.py"
    bad.write_text("from typing import TYPE_CHECKING\nfrom ..scheduler.engine import Engine\n"
                   "if TYPE_CHECKING:\n    from . import model\n"
                   "def f():\n    from ..lang import program\n")
    found = imports("radixserve.kernels.bad", bad, {"radixserve.kernels.model", "radixserve.lang.program"})
    assert found == [("radixserve.scheduler.engine", 2, "load"), ("radixserve.kernels.model", 4, "typing"),
                     ("radixserve.lang.program", 6, "call")]
    assert folder(found[0][0]) not in LAYERS["kernels"] and folder(found[2][0]) not in LAYERS["kernels"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_checkout_root_never_shadows_other_packages():
    """`python -m` from the checkout's root puts it on sys.path, where `kernels/` would shadow Hugging Face's
    `kernels` (transformers imports it when installed); importing radixserve.frontend (servers) or .bench takes the
    root off the path."""
    import subprocess
    import sys

    code = ("import importlib.util, sys; import radixserve.{}; spec = importlib.util.find_spec('kernels'); "
            "print(spec.origin if spec else None)")
    for package in ("frontend", "bench"):
        out = subprocess.run([sys.executable, "-c", code.format(package)], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        assert out == "None" or not out.startswith(str(ROOT)), out
    shadowed = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('kernels')"
                               ".origin)"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert shadowed.startswith(str(ROOT))  # what happens without it
