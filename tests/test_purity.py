"""The pure core stays pure: controller.model and controller.engine do no I/O and read no clock.

Two independent checks: import-linter's contracts (pyproject.toml) over the whole import graph,
and an AST scan of every module in the pure packages for I/O modules, clocks, randomness and I/O
builtins. The simulator relies on this: it drives exactly the production decisions only because
those decisions depend on nothing but their arguments.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = [ROOT / "controller" / "model", ROOT / "controller" / "engine"]
FORBIDDEN_MODULES = {
    "os", "io", "sys", "time", "random", "socket", "subprocess", "threading", "asyncio", "pathlib",
    "shutil", "tempfile", "logging", "urllib", "http", "requests", "aiohttp", "kopf", "kubernetes",
    "multiprocessing", "signal", "select",
}  # fmt: skip
#: ``datetime`` may parse and format timestamps (resources.py) but never read the clock.
CLOCK_ATTRIBUTES = {"now", "utcnow", "today", "monotonic", "perf_counter", "time_ns"}
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval", "__import__", "breakpoint"}


def pure_modules() -> list[Path]:
    return sorted(p for d in PURE for p in d.rglob("*.py"))


def violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            names = []
        found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in FORBIDDEN_MODULES]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            found.append(f"{path.name}:{node.lineno} calls {node.func.id}()")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CLOCK_ATTRIBUTES:
            found.append(f"{path.name}:{node.lineno} reads the clock ({node.func.attr})")
    return found


def test_pure_packages_exist() -> None:
    assert len(pure_modules()) > 10


@pytest.mark.parametrize("path", pure_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_io_in_pure_core(path: Path) -> None:
    assert violations(path) == []


def test_scanner_catches_io(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom time import monotonic\nimport kubernetes.client\nopen('x')\ndatetime.now()\n")
    assert len(violations(bad)) == 5


def test_import_linter_contracts() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is part of the test extra"
    result = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def module_cycles() -> list[tuple[str, ...]]:
    """Every import cycle between two modules of ``controller`` (through any others), TYPE_CHECKING imports
    included: each as the sorted modules of one shortest cycle through an import."""
    import grimp

    graph = grimp.build_graph("controller", cache_dir=None)
    found: set[tuple[str, ...]] = set()
    for importer in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(importer):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                found.add(tuple(sorted(set(back))))
    return sorted(found)


def test_no_import_cycles() -> None:
    """Issue 37 cut the last two (metrics <-> runner, sim history <-> workload; import-linter's contracts keep those
    two apart): a module that needs a type of the one that imports it declares a small Protocol instead."""
    assert module_cycles() == []
