"""Compiled CPU kernels (csrc/*.cpp), each built on first use with torch.utils.cpp_extension and
cached by torch between processes (a build takes about a minute).

The machine decides the code path at run time. A kernel's source holds a portable path (plain
C++, vectorized by the compiler for baseline x86-64) and fast paths behind instruction-set
macros; each instruction-set level is a separate build of the same source with its own flags:

    level         needs (from /proc/cpuinfo)                       what turns on in the source
    portable      nothing                                          the portable loops only
    avx2          avx2, fma, f16c                                  __AVX2__ paths
    avx512        avx512f/bw/vl/dq, fma, f16c                       __AVX512F__ paths
    avx512_bf16   avx512 + avx512_bf16                             __AVX512BF16__ paths too
    avx512_vnni   avx512 + avx512_vnni                             __AVX512VNNI__ paths too

`load(name)` builds and loads the best level the kernel has and this CPU runs; tests load a
lower one (`load(name, "portable")`) to check every path on every machine. The environment
variable KVSERVE_KERNELS (read in config) turns every compiled kernel off ("off": the torch
paths run) or holds every kernel to its portable path ("portable").

Where one cannot be built (no compiler, no ninja, a read-only cache) the caller runs its torch
path instead; the reason is logged once and kept in `failure(name)`.
  paged_attention  decode attention reading K/V blocks in place through the block table
  linear_bf16      bf16 x @ W^T for a few rows of x at memory bandwidth
  linear_quant     x @ W^T with W packed in GGUF's Q8_0 / Q4_0 / Q4_1 blocks, and their dequantization
  linear_q8        x @ W^T with W in Q4_0 / Q4_1 / Q8_0 blocks and x quantized to 8 bits a block (integer dots)
  layer_ops        a decoder layer's RMSNorm, RoPE and SiLU-times-up, one call each
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Optional

from kvserve.config import env_cxx, env_kernel_mode

logger = logging.getLogger("kvserve")
BASE_FLAGS = ["-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
              "-fno-trapping-math", "-fopenmp"]


@dataclass(frozen=True)
class Isa:
    name: str
    cpu_flags: frozenset[str]  # as /proc/cpuinfo names them
    cflags: tuple[str, ...]


_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx2"})
ISAS = {
    "portable": Isa("portable", frozenset(), ()),
    "avx2": Isa("avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
    "avx512": Isa("avx512", _AVX512, ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw",
                                      "-mavx512vl", "-mavx512dq")),
    "avx512_bf16": Isa("avx512_bf16", _AVX512 | {"avx512_bf16"},
                       ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                        "-mavx512dq", "-mavx512bf16")),
    "avx512_vnni": Isa("avx512_vnni", _AVX512 | {"avx512_vnni"},
                       ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                        "-mavx512dq", "-mavx512vnni")),
}
# The levels each kernel has code for, lowest first.
KERNEL_ISAS = {
    "paged_attention": ("portable", "avx2", "avx512"),
    "linear_bf16": ("portable", "avx512_bf16"),
    "linear_quant": ("portable", "avx2", "avx512"),
    "linear_q8": ("portable", "avx2", "avx512_vnni"),
    "layer_ops": ("portable", "avx2", "avx512"),
}

_modules: dict[tuple[str, str], Any] = {}
_failures: dict[str, str] = {}


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
    """The compiled module csrc/<name>.cpp at level `isa` (default: `best_isa`), or None with the
    reason in `failure(name)`. Asking for a level this CPU cannot run is a ValueError."""
    if isa is None:
        isa = best_isa(name)
        if isa is None:
            return None
    if isa not in supported_isas(name):
        raise ValueError(f"kernel {name} has no {isa!r} path this CPU runs; it runs {supported_isas(name)}")
    key = (name, isa)
    if key not in _modules and name not in _failures:
        _modules[key] = _build(name, ISAS[isa])
    return _modules.get(key)


def _build(name: str, isa: Isa) -> Optional[Any]:
    try:
        from torch.utils.cpp_extension import load as build
        src = os.path.join(os.path.dirname(__file__), "csrc", f"{name}.cpp")
        return build(name=f"kvserve_{name}_{isa.name}", sources=[src],
                     extra_cflags=BASE_FLAGS + list(isa.cflags), extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a sandbox without /tmp ...
        _failures[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        logger.warning("CPU kernel %s unavailable (%s); using the torch path", name, _failures[name])
        return None


def failure(name: str) -> Optional[str]:
    """Why `load(name)` gives None, if it does."""
    if env_kernel_mode() == "off":
        return "compiled kernels are turned off (KVSERVE_KERNELS=off)"
    return _failures.get(name)


def has_compiler() -> bool:
    """Whether a C++ compiler is on the PATH (without one every kernel falls back to torch)."""
    return shutil.which(env_cxx()) is not None
