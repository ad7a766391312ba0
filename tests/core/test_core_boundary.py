"""kvserve.core stays pure Python and fully typed: importing it loads no torch, and it passes
`mypy --strict` (imports from outside core are followed silently, not judged here)."""

import sys
from pathlib import Path

import kvserve
from tests.processes import run

CORE = Path(kvserve.__file__).parent / "core"


def test_core_imports_without_torch():
    code = ("import sys, importlib, pkgutil, kvserve.core as c\n"
            "for m in pkgutil.iter_modules(c.__path__): importlib.import_module('kvserve.core.' + m.name)\n"
            "print('torch' in sys.modules)")
    # kvserve/__init__ exposes LLM lazily, so importing a core module must not pull in torch
    out = run([sys.executable, "-c", code], check=True)  # a failure shows its stderr
    assert out.stdout.strip() == "False", out.stderr


def test_core_passes_mypy_strict():
    from mypy import api
    stdout, stderr, status = api.run(["--strict", "--follow-imports=silent", "--no-incremental", str(CORE)])
    assert status == 0, stdout + stderr
