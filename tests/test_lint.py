"""`ruff check` is clean over the package, its tests and the benchmarks (rules in pyproject.toml:
pyflakes and pycodestyle's errors), so an unused import or an undefined name fails the suite."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "kvserve", "tests", "benchmarks"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
