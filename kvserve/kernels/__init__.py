"""Compiled CPU kernels (csrc/*.cpp), built at install by setup.py into kvserve.kernels.built and
chosen at run time by this CPU's flags. Nothing is compiled while a user waits.

A kernel's source holds a portable path (plain C++, vectorized by the compiler for baseline x86-64)
and fast paths behind instruction-set macros; each instruction-set level is a separate build of
the same source with its own flags (kvserve/kernels/levels.py: the levels, their flags and the CPU
flags each needs). `load(name)` imports the best level the kernel has and this CPU runs; tests load
a lower one (`load(name, "portable")`) to check every path on every machine. The environment
variable KVSERVE_KERNELS (read in config) turns every compiled kernel off ("off": the torch paths
run) or holds every kernel to its portable path ("portable").

Where a build is missing (installed without a C++ compiler, a level the compiler could not build)
or stale (its sources changed since the install built it), the caller runs its torch path instead;
kvserve says so once, and `failure(name)` keeps the reason.
  paged_attention  decode attention reading K/V blocks in place through the block table
  linear_bf16      bf16 x @ W^T for a few rows of x at memory bandwidth
  linear_quant     x @ W^T with W packed in GGUF's Q8_0 / Q4_0 / Q4_1 blocks, and their dequantization
  linear_wide      fp32 x @ W^T with W kept in fp16 / bf16 (a GGUF's F16 / BF16 matrices under an fp32 model)
  linear_q8        x @ W^T with W in Q4_0 / Q4_1 / Q8_0 blocks and x quantized to 8 bits a block (integer dots)
  layer_ops        a decoder layer's RMSNorm, RoPE and SiLU-times-up, one call each, and its whole decode
                   step in one call (DecodeLayer: the other kernels' products and attention through
                   capsules, csrc/kernel_ops.h), and every layer's in one (DecodeStack)
  linear_kquant    x @ W^T with W in GGUF K-quant / Q5_0 / Q5_1 / IQ4_NL blocks (fp32 or int8 activations), and their dequantization
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

from kvserve.config import env_kernel_mode
from kvserve.kernels.levels import (BUILT_PACKAGE, ISAS, KERNEL_ISAS, REPORT_FILE, Isa, module_name,
                                    source_digest)

__all__ = ["ISAS", "KERNEL_ISAS", "Isa", "best_isa", "build_report", "cpu_flags", "failure", "import_seconds", "load",
           "summary", "supported_isas"]
logger = logging.getLogger("kvserve")
CSRC = Path(__file__).parent / "csrc"
BUILT = Path(__file__).parent / "built"

_modules: dict[tuple[str, str], Any] = {}
_failures: dict[str, str] = {}
_warned: list[str] = []
_import_seconds: list[float] = []


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_isas(name: str) -> list[str]:
    """The levels of kernel `name` this CPU can run, lowest first."""
    return [isa for isa in KERNEL_ISAS[name] if ISAS[isa].cpu_flags <= cpu_flags()]


def best_isa(name: str) -> Optional[str]:
    """The level `load(name)` takes: the highest this CPU runs, held down by KVSERVE_KERNELS."""
    mode = env_kernel_mode()
    if mode == "off":
        return None
    return "portable" if mode == "portable" else supported_isas(name)[-1]


def load(name: str, isa: Optional[str] = None) -> Optional[Any]:
    """The built module of csrc/<name>.cpp at level `isa` (default: `best_isa`), or None with the
    reason in `failure(name)`. Asking for a level this CPU cannot run is a ValueError."""
    if isa is None:
        isa = best_isa(name)
        if isa is None:
            return None
    if isa not in supported_isas(name):
        raise ValueError(f"kernel {name} has no {isa!r} path this CPU runs; it runs {supported_isas(name)}")
    key = (name, isa)
    if key not in _modules:
        start = time.perf_counter()
        _modules[key] = _import(name, isa)
        _import_seconds.append(time.perf_counter() - start)
    return _modules[key]


def import_seconds() -> float:
    """The time this process spent importing kernel builds (start-up reports it)."""
    return sum(_import_seconds)


def _import(name: str, isa: str) -> Optional[Any]:
    import torch  # noqa: F401  (the built modules link against libtorch, loaded by this import)
    module = module_name(name, isa)
    reason = _unusable(name, module)
    if reason is None:
        try:
            return importlib.import_module(f"{BUILT_PACKAGE}.{module}")
        except ImportError as e:
            reason = f"the build of {module} does not load ({e})"
    _failures[name] = reason
    if not _warned:  # once a process: the same cause usually holds for every kernel
        logger.warning("compiled CPU kernels unavailable (%s); the torch paths run instead. "
                       "Reinstall with a C++ compiler on the PATH (bash scripts/setup.sh) to build them", reason)
    _warned.append(name)
    return None


def _unusable(name: str, module: str) -> Optional[str]:
    """Why the installed build `module` of kernel `name` cannot be used, or None if it can."""
    report = build_report()
    if report is None:
        return "kvserve was installed without its kernel builds (no kvserve/kernels/built/report.json)"
    entry = report.get(module)
    if entry is None:
        return f"the install built no {module} (its report does not list it: reinstall kvserve)"
    if not entry.get("built"):
        return f"{module} did not build at install: {entry.get('reason')}"
    if entry.get("sources") != source_digest(CSRC, name):
        return f"{module} is stale: csrc/{name}.cpp or its headers changed since the install built it"
    return None


@functools.lru_cache(maxsize=1)
def build_report() -> Optional[dict[str, dict]]:
    """What the install built: {module: {"built", "sources", "seconds" | "reason"}}, or None."""
    try:
        return json.loads((BUILT / REPORT_FILE).read_text())
    except (OSError, ValueError):
        return None


def summary(loaded_only: bool = False) -> str:
    """One line on the kernels: what the install built and the level each kernel runs here
    (loaded_only: only those this process has loaded, without importing the others)."""
    import torch
    report = build_report() or {}
    built = sum(1 for entry in report.values() if entry.get("built"))
    names = [name for name, _ in _modules] if loaded_only else list(KERNEL_ISAS)
    chosen = ", ".join(f"{name} {isa if load(name) is not None else 'torch'}"
                       for name in dict.fromkeys(names) for isa in [best_isa(name) or "off"])
    return f"torch {torch.__version__}; kernels: {built} of {len(report)} builds installed; running {chosen or 'none'}"


def failure(name: str) -> Optional[str]:
    """Why `load(name)` gives None, if it does."""
    if env_kernel_mode() == "off":
        return "compiled kernels are turned off (KVSERVE_KERNELS=off)"
    return _failures.get(name)
