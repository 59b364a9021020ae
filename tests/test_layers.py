"""The packages form layers that import one way only, and nothing imports in a cycle.

    bench        speed and memory benchmarks, the GPU acceptance run: may import everything below
    launch       the CLI, Slurm and sweeps: everything below
    experiments  studies beside the pipeline (the synthetic tasks): pipeline, fpa_model, data_prep
    pipeline     stages, trainer, checkpoints, evaluation: fpa_model, data_prep
    fpa_model    the model and its attention ops: none of our packages
    data_prep    corpora, tokenizer, shards, loader: none of our packages

Imports are read from the source (ast), function-local ones included: a local import still ties the
layers together, it only hides the tie until the function runs. Each package is also imported alone in a
fresh interpreter, module by module, so that an import-time cycle fails here and not in a user's shell.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# What each of our packages may import (besides itself). Everything else of ours is a violation.
ALLOWED: dict[str, set[str]] = {
    "data_prep": set(),
    "fpa_model": set(),
    "pipeline": {"data_prep", "fpa_model"},
    "experiments": {"pipeline", "data_prep", "fpa_model"},
    "launch": {"experiments", "pipeline", "data_prep", "fpa_model"},
    "bench": {"launch", "experiments", "pipeline", "data_prep", "fpa_model"},
}
PACKAGES = sorted(ALLOWED)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(package: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((REPO / package).rglob("*.py"))}


ALL_MODULES: dict[str, Path] = {m: p for pkg in PACKAGES for m, p in _modules(pkg).items()}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of our packages in the file, at any depth (functions included).

    `from a.b import c` names a.b.c when that is one of our modules, else a.b; relative imports are
    resolved against the file's package.
    """
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if sub in ALL_MODULES else base))
    return [(line, mod) for line, mod in found if mod.split(".")[0] in ALLOWED]


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_the_layers_below(package: str) -> None:
    bad = []
    for path in _modules(package).values():
        for line, target in _imports(path):
            top = target.split(".")[0]
            if top != package and top not in ALLOWED[package]:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    allowed = ", ".join(sorted(ALLOWED[package])) or "none of our packages"
    assert not bad, f"{package} may import {allowed}; found:\n" + "\n".join(bad)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_no_import_cycles_between_modules() -> None:
    """No module reaches itself through imports, function-local ones included (the layers rule out cycles
    between packages; this rules them out inside a package). A module's import of its own submodule (a
    package __init__ re-exporting) is the one edge Python always resolves and is left out."""
    graph = {
        mod: {t for _, t in _imports(path) if t in ALL_MODULES and t != mod and not t.startswith(mod + ".")}
        for mod, path in ALL_MODULES.items()
    }
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checks_see_a_violation() -> None:
    """The checks above fail on what they exist for (a guard against a reader that sees nothing)."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    found = {t for _, t in _imports(REPO / "launch" / "cli.py")}
    assert "pipeline.config" in found and "pipeline.train" in found  # top-level and function-local


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_alone(package: str) -> None:
    """A fresh interpreter imports every module of the package, the package's own first, in file order."""
    mods = list(_modules(package))
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    proc = subprocess.run(
        [sys.executable, "-c", code, *mods], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"importing {package} alone failed:\n{proc.stderr[-3000:]}"
