"""The layers point down. kvserve's subpackages and top-level modules stand on floors (FLOORS,
from the top); a module imports from its own floor or lower, never higher, and never in a
circle. Read from the source, so a lazy import inside a function and an `if TYPE_CHECKING:`
import count as much as one at the top of a module.

The package root (kvserve/__init__.py) is the top of the floors and is exempt: it re-exports
LLM and SamplingParams, and it plugs kvserve.distributed into the engine's seam for tensor
parallelism (kvserve/engine/parallel.py). Where a lower floor must call up, it defines an
interface that the higher floor registers with (docs/architecture.md, after the package tree).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import kvserve

PACKAGE = Path(kvserve.__file__).parent
ROOT = "kvserve"

# From the top. Each name is a subpackage (kvserve/NAME/) or a top-level module (kvserve/NAME.py).
FLOORS: list[set[str]] = [
    {"cli"},
    {"server", "bench"},
    {"distributed"},
    {"engine", "eval", "spec"},
    {"runner"},
    {"models"},
    {"attention"},
    {"kv", "kernels"},
    {"core", "tokenizer"},
    {"config", "modules"},  # config and small shared utilities
]
FLOOR_OF = {unit: i for i, floor in enumerate(FLOORS) for unit in floor}


@dataclass(frozen=True)
class Import:
    path: Path  # the importing file
    line: int
    module: str  # the kvserve module imported, as far as the source names it
    type_checking: bool  # under `if TYPE_CHECKING:`: never executed

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(PACKAGE.parent)}:{self.line}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """Whether kvserve module `name` is a file or package here."""
    base = PACKAGE.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or base.is_dir()


def unit_of(module: str) -> Optional[str]:
    """The subpackage or top-level module `module` belongs to (None: the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def source_files() -> Iterator[Path]:
    return (p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.AST, path: Path) -> list[str]:
    """The modules one node imports: `from kvserve.a import b` names kvserve.a.b where b is a
    module (else kvserve.a); relative imports resolved; import_module("kvserve.x") counted."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module_name(path).split(".")
            package = package if path.name == "__init__.py" else package[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        names = [f"{base}.{alias.name}" for alias in node.names]
        return [n for n in names if is_module(n)] or [base]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    return []


def imports(path: Path) -> list[Import]:
    """Every import of a kvserve module in the file, wherever it stands."""
    found: list[Import] = []

    def visit(node: ast.AST, type_checking: bool) -> None:
        for module in _targets(node, path):
            if module == ROOT or module.startswith(ROOT + "."):
                found.append(Import(path, getattr(node, "lineno", 0), module, type_checking))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_checking)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking)

    visit(ast.parse(path.read_text()), False)
    return found


def all_imports() -> list[Import]:
    return [imp for path in source_files() if path != PACKAGE / "__init__.py" for imp in imports(path)]


def floor_name(unit: Optional[str]) -> str:
    if unit is None:
        return "the package root (the top)"
    i = FLOOR_OF[unit]
    return f"floor {i} ({', '.join(sorted(FLOORS[i]))})"


def tagged(imp: Import) -> str:
    return imp.module + (" (under TYPE_CHECKING)" if imp.type_checking else "")


def units_here() -> set[str]:
    units = set()
    for path in source_files():
        unit = unit_of(module_name(path))
        if unit is not None:
            units.add(unit)
    return units


# ---- every unit on a floor ----
def test_every_subpackage_and_module_stands_on_a_floor():
    placed = [unit for floor in FLOORS for unit in floor]
    assert len(placed) == len(set(placed)), f"a unit stands on two floors: {sorted(placed)}"
    here = units_here()
    unplaced = sorted(here - set(placed))
    assert not unplaced, (f"kvserve/{unplaced[0]} stands on no floor: add {unplaced} to FLOORS in "
                          f"tests/test_layering.py, on the floor its imports allow")
    gone = sorted(set(placed) - here)
    assert not gone, f"FLOORS names {gone}, which kvserve no longer has"


# ---- imports point down ----
def test_no_module_imports_from_a_higher_floor():
    found = []
    for imp in all_imports():
        source, target = unit_of(module_name(imp.path)), unit_of(imp.module)
        if source not in FLOOR_OF or (target is not None and target not in FLOOR_OF):
            continue  # on no floor: the test above names it
        if target is None or FLOOR_OF[target] < FLOOR_OF[source]:
            found.append(f"  {source} -> {target or ROOT}: {imp.where} imports {tagged(imp)}, "
                         f"from {floor_name(source)} up to {floor_name(target)}")
    assert not found, "imports from a higher floor (floor 0, cli, is the top):\n" + "\n".join(found)


# ---- no circles ----
def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def describe(component: list[str], witnesses: dict[tuple[str, str], Import]) -> str:
    inside = set(component)
    lines = [f"  {a} -> {b}: {imp.where} imports {tagged(imp)}"
             for (a, b), imp in sorted(witnesses.items()) if a in inside and b in inside]
    return " <-> ".join(component) + "\n" + "\n".join(lines)


def test_no_circle_between_subpackages():
    """Type-checking imports count: a circle of annotations is still two floors leaning on
    each other."""
    edges: dict[str, set[str]] = defaultdict(set)
    witnesses: dict[tuple[str, str], Import] = {}
    for imp in all_imports():
        source, target = unit_of(module_name(imp.path)), unit_of(imp.module)
        if target is not None and source != target:
            edges[str(source)].add(target)
            witnesses.setdefault((str(source), target), imp)
    found = cycles(edges)
    assert not found, "subpackages in a circle:\n" + "\n".join(describe(c, witnesses) for c in found)


def test_no_circle_between_modules():
    """No circle of modules that run their imports, lazy ones included. A circle that closes
    only through `if TYPE_CHECKING:` imports is let be: those imports never run, so there is
    no import order to get wrong, and one between subpackages is refused by the test above;
    what is left is two modules of one subpackage naming each other's types in annotations."""
    edges: dict[str, set[str]] = defaultdict(set)
    witnesses: dict[tuple[str, str], Import] = {}
    for imp in all_imports():
        source, target = module_name(imp.path), imp.module
        if imp.type_checking or target in (source, ROOT):
            continue
        edges[source].add(target)
        witnesses.setdefault((source, target), imp)
    found = cycles(edges)
    assert not found, "modules in a circle:\n" + "\n".join(describe(c, witnesses) for c in found)


# ---- the two oldest rules, stated on their own ----
def test_core_imports_only_core_and_config():
    for path in (PACKAGE / "core").rglob("*.py"):
        outside = {imp.module for imp in imports(path)
                   if not (imp.module.startswith("kvserve.core") or imp.module == "kvserve.config")}
        assert not outside, f"{path.relative_to(PACKAGE)} imports {sorted(outside)}"


def test_nothing_imports_the_command_line():
    for path in source_files():
        if path == PACKAGE / "cli.py":
            continue
        found = [imp.where for imp in imports(path) if imp.module == "kvserve.cli"]
        assert not found, f"{found[0]} imports kvserve.cli"
