"""Which builds of the compiled kernels exist: the instruction-set levels, the compiler flags that
turn each on, the CPU flags each needs, and the levels each kernel has code for.

Plain data and the standard library only: `setup.py` reads this file at install to know what to
build, and `kvserve.kernels` reads it at run time to know what to load, so the two never disagree.

    level         needs (from /proc/cpuinfo)                       what turns on in the source
    portable      nothing                                          the portable loops only
    avx2          avx2, fma, f16c                                  __AVX2__ paths
    avx512        avx512f/bw/vl/dq, fma, f16c                       __AVX512F__ paths
    avx512_bf16   avx512 + avx512_bf16                             __AVX512BF16__ paths too
    avx512_vnni   avx512 + avx512_vnni                             __AVX512VNNI__ paths too
    amx           avx512_vnni + avx512_bf16, amx_tile, amx_int8,  __AMX_INT8__, __AMX_BF16__ paths too
                  amx_bf16

A kernel may add flags of its own to every level's (KERNEL_CFLAGS).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

BASE_FLAGS = ("-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
              "-fno-trapping-math", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)
# The package that holds the built modules, one a (kernel, level): kvserve.kernels.built.<name>_<level>
BUILT_PACKAGE = "kvserve.kernels.built"
# Written beside the built modules at install: which builds exist and why any does not.
REPORT_FILE = "report.json"


@dataclass(frozen=True)
class Isa:
    name: str
    cpu_flags: frozenset[str]  # as /proc/cpuinfo names them
    cflags: tuple[str, ...]


_AVX512_CPU = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx2"})
_AVX512_CFLAGS = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
ISAS = {
    "portable": Isa("portable", frozenset(), ()),
    "avx2": Isa("avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
    "avx512": Isa("avx512", _AVX512_CPU, _AVX512_CFLAGS),
    "avx512_bf16": Isa("avx512_bf16", _AVX512_CPU | {"avx512_bf16"}, _AVX512_CFLAGS + ("-mavx512bf16",)),
    "avx512_vnni": Isa("avx512_vnni", _AVX512_CPU | {"avx512_vnni"}, _AVX512_CFLAGS + ("-mavx512vnni",)),
    "amx": Isa("amx", _AVX512_CPU | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
               _AVX512_CFLAGS + ("-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16")),
}
# The levels each kernel has code for, lowest first.
KERNEL_ISAS = {
    "paged_attention": ("portable", "avx2", "avx512"),
    "linear_bf16": ("portable", "avx512_bf16"),
    "linear_quant": ("portable", "avx2", "avx512"),
    "linear_wide": ("portable", "avx2", "avx512"),
    "linear_q8": ("portable", "avx2", "avx512_vnni", "amx"),
    "layer_ops": ("portable", "avx2", "avx512"),
    "linear_kquant": ("portable", "avx2", "avx512", "avx512_vnni"),
    "mla_attention": ("portable", "avx2", "avx512"),
    "chunk_attention": ("portable", "avx2", "avx512"),
}
# Flags a kernel adds to every level's: linear_kquant's dequantization must round the product and
# the sum of `scale * q + offset` apart, as the gguf package does, never as one fused multiply-add
# (its products use explicit FMA instructions, which this flag leaves alone); chunk_attention sums
# a query's keys in one order whichever chunk it is in, so the compiler may not regroup its sums.
KERNEL_CFLAGS = {"linear_kquant": ("-ffp-contract=off",), "chunk_attention": ("-fno-associative-math",)}


def module_name(kernel: str, isa: str) -> str:
    """The built module's name inside BUILT_PACKAGE: module_name("layer_ops", "avx2") == "layer_ops_avx2"."""
    return f"{kernel}_{isa}"


def all_builds() -> list[tuple[str, str]]:
    """Every (kernel, level) the package ships a build of."""
    return [(kernel, isa) for kernel, isas in KERNEL_ISAS.items() for isa in isas]


def source_digest(csrc: Path, kernel: str) -> str:
    """A digest of what a kernel's builds are compiled from (its source and the shared headers):
    a build whose recorded digest differs from the sources beside it is stale."""
    h = hashlib.sha256()
    for path in [csrc / f"{kernel}.cpp", *sorted(csrc.glob("*.h"))]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]
