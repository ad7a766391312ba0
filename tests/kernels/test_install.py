"""The kernels come with the install: nothing is compiled, locked or cached while kvserve starts,
so a start killed at any point leaves nothing behind, and another install of kvserve (a second
virtual environment) neither shares nor rebuilds the first one's kernels."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from kvserve import kernels
from kvserve.kernels.levels import REPORT_FILE, all_builds, module_name, source_digest

GENERATE = ["-m", "kvserve.cli", "generate", "Once upon a time", "--max-tokens", "8", "--temperature", "0"]


def quiet_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a start, with torch's extension cache pointed at a folder that must
    stay absent (a JIT build would write there)."""
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}


def skip_without_compiler() -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here: the install could build no kernels")


def test_the_install_built_every_level_of_every_kernel():
    report = kernels.build_report()
    assert report is not None, "no kvserve/kernels/built/report.json: setup.py built no kernels"
    skip_without_compiler()
    for kernel, isa in all_builds():
        entry = report.get(module_name(kernel, isa))
        assert entry is not None and entry["built"], (kernel, isa, entry)
        assert entry["sources"] == source_digest(kernels.CSRC, kernel), f"{kernel} {isa} is stale: reinstall"


def test_every_level_this_cpu_runs_loads_from_the_package(monkeypatch):
    monkeypatch.setenv("KVSERVE_KERNELS", "auto")
    skip_without_compiler()
    for name in kernels.KERNEL_ISAS:
        for isa in kernels.supported_isas(name):
            module = kernels.load(name, isa)
            assert module is not None, kernels.failure(name)
            assert Path(module.__file__).parent == kernels.BUILT and module.isa() == isa


def test_a_stale_or_missing_build_is_refused_with_its_reason(monkeypatch, tmp_path):
    """A build whose sources changed since the install is never loaded (its entry points may
    differ): the torch path runs and the reason names the fix."""
    monkeypatch.setenv("KVSERVE_KERNELS", "auto")
    monkeypatch.setattr(kernels, "_modules", {})
    monkeypatch.setattr(kernels, "_failures", {})
    monkeypatch.setattr(kernels, "_warned", [])
    report = {module_name("layer_ops", isa): {"built": True, "sources": "0" * 16} for isa in kernels.KERNEL_ISAS["layer_ops"]}
    report[module_name("linear_quant", "portable")] = {"built": False, "reason": "CompileError: no compiler"}
    monkeypatch.setattr(kernels, "build_report", lambda: report)
    assert kernels.load("layer_ops", "portable") is None
    assert "stale" in kernels.failure("layer_ops") and "layer_ops.cpp" in kernels.failure("layer_ops")
    assert kernels.load("linear_quant", "portable") is None
    assert "did not build at install: CompileError: no compiler" in kernels.failure("linear_quant")
    assert kernels.load("paged_attention", "portable") is None and "report does not list" in kernels.failure("paged_attention")
    monkeypatch.setattr(kernels, "build_report", lambda: None)
    monkeypatch.setattr(kernels, "_modules", {})
    assert kernels.load("layer_ops", "portable") is None and "without its kernel builds" in kernels.failure("layer_ops")


@pytest.mark.slow
def test_a_start_killed_at_any_point_does_not_stall_the_next(stories_path, tmp_path):
    """Kill `kvserve generate` at random points of its start (SIGKILL: no clean-up runs), then a
    new one runs to completion within 60 s and nothing was written to a build cache."""
    env = quiet_env(tmp_path)
    cmd = [sys.executable, *GENERATE, "--model", stories_path]
    rng = random.Random(25)
    for delay in sorted(rng.uniform(0.05, 4.0) for _ in range(5)):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            time.sleep(delay)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), "the completed run printed no text"
    assert not (tmp_path / "torch_extensions").exists()


def second_venv(tmp_path: Path) -> Path:
    """Another install of kvserve beside this one: a virtual environment with its own copy of the
    package (as pip lays out a wheel), the other dependencies taken from this environment."""
    venv = tmp_path / "venv2"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    here = Path(sysconfig.get_paths()["purelib"])
    (site / "deps.pth").write_text(f"{here}\n")  # after the venv's own site-packages: its kvserve wins
    shutil.copytree(kernels.CSRC.parents[1], site / "kvserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return venv


@pytest.mark.slow
def test_a_second_install_neither_shares_nor_rebuilds_the_first_ones_kernels(stories_path, tmp_path):
    skip_without_compiler()
    venv = second_venv(tmp_path)
    env = quiet_env(tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in kernels.BUILT.iterdir()}
    probe = ("from kvserve import kernels; m = kernels.load('layer_ops'); "
             "print(m.__file__ if m is not None else kernels.failure('layer_ops'))")
    second = subprocess.run([str(venv / "bin" / "python"), "-c", probe], env=env, capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    ran = subprocess.run([str(venv / "bin" / "python"), *GENERATE, "--model", stories_path], env=env,
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    first = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    if os.environ.get("KVSERVE_KERNELS", "auto") != "off":
        assert Path(second.stdout.strip()).is_relative_to(venv), second.stdout  # its own builds
        assert Path(first.stdout.strip()).parent == kernels.BUILT, first.stdout
    assert {p.name: p.stat().st_mtime_ns for p in kernels.BUILT.iterdir()} == before  # nothing rebuilt here
    assert not (tmp_path / "torch_extensions").exists()
    assert json.loads((kernels.BUILT / REPORT_FILE).read_text()) == kernels.build_report()


@pytest.mark.slow
def test_an_install_without_a_compiler_succeeds_and_says_why(tmp_path):
    """pip builds kvserve where no C++ compiler is on the PATH: the wheel is made, holds no
    kernel build, and its report names the cause for each, which the runtime then repeats."""
    repo = kernels.CSRC.parents[2]
    tree = tmp_path / "tree"
    shutil.copytree(repo, tree, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.so", "report.json",
                                                              "build", "*.egg-info", ".pytest_cache", ".peers"))
    bare = tmp_path / "bin"  # nothing on the PATH but what pip needs
    bare.mkdir()
    env = {**os.environ, "PATH": str(bare), "CC": "cc", "CXX": "c++"}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
                            "-w", str(tmp_path / "wheel"), str(tree)], env=env, capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    import zipfile
    (wheel,) = (tmp_path / "wheel").glob("kvserve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        report = json.loads(z.read(f"kvserve/kernels/built/{REPORT_FILE}"))
    assert not [n for n in names if n.endswith(".so")]
    assert set(report) == {module_name(k, i) for k, i in all_builds()}
    assert all(not e["built"] and "No such file or directory" in e["reason"] for e in report.values()), report
