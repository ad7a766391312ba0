"""The layers point one way: `core/` uses only itself and `config`; nothing but `cli` itself and
`__main__` reaches into the command line. Read from the source, so a lazy import inside a
function counts as much as one at the top of a module."""

import ast
from pathlib import Path

import kvserve

PACKAGE = Path(kvserve.__file__).parent


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def kvserve_imports(path: Path) -> set[str]:
    return {m for m in imported_modules(path) if m == "kvserve" or m.startswith("kvserve.")}


def test_core_imports_only_core_and_config():
    for path in (PACKAGE / "core").rglob("*.py"):
        outside = {m for m in kvserve_imports(path)
                   if not (m.startswith("kvserve.core") or m == "kvserve.config")}
        assert not outside, f"{path.relative_to(PACKAGE)} imports {sorted(outside)}"


def test_nothing_imports_the_command_line():
    for path in PACKAGE.rglob("*.py"):
        if path.name == "cli.py":
            continue
        assert "kvserve.cli" not in kvserve_imports(path), f"{path.relative_to(PACKAGE)} imports kvserve.cli"
