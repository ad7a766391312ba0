"""The machine a benchmark ran on, as stored beside its figures, and a short stable name for its
kind, so runs on the same kind of machine are kept (and compared) together.

    m = Machine.here(threads=2)
    m.kind        # "intel-xeon-amx", "amd-epyc-zen4-avx512", "amd-epyc-zen3-avx2"
    m.as_dict()   # CPU model, flags that matter, kernel levels, cores, threads, torch, load

The kind is the vendor, the product line (and AMD's Zen generation, from cpuinfo's family and
model numbers, which the marketing name does not always carry), and the widest vector feature
kvserve's kernels use there: amx, avx512, avx2 or portable. Kernels held down by KVSERVE_KERNELS
run other code on the same CPU, so that mode joins the kind ("-kernels-portable").
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from typing import Any, Optional

# The CPU flags a benchmark's reader needs to explain its figures.
FLAGS_THAT_MATTER = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16",
                     "amx_tile", "amx_int8", "amx_bf16")
PRODUCT_LINES = ("xeon", "epyc", "threadripper", "ryzen", "core", "neoverse", "graviton")
# AMD family 0x19 models: Zen 3 (Milan, Vermeer, Cezanne, ...) and Zen 4 (Genoa, Raphael, ...)
ZEN3_MODELS_19H = (range(0x00, 0x10), range(0x20, 0x60))
ZEN4_MODELS_19H = (range(0x10, 0x20), range(0x60, 0xB0))


def parse_cpuinfo(text: str) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo's text ({"model name": ..., "flags": ...})."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block ends at its blank line
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def zen_generation(family: Optional[int], model: Optional[int]) -> Optional[str]:
    """AMD's core generation from cpuinfo's numbers: zen_generation(25, 1) == "zen3" (EPYC 7xx3),
    zen_generation(25, 0x11) == "zen4" (EPYC 9xx4); None where they name no Zen core."""
    if family == 0x17 and model is not None:
        return "zen2" if model >= 0x30 else "zen"
    if family == 0x19 and model is not None:
        if any(model in r for r in ZEN3_MODELS_19H):
            return "zen3"
        if any(model in r for r in ZEN4_MODELS_19H):
            return "zen4"
    if family == 0x1A:
        return "zen5"
    return None


def vector_feature(flags: frozenset[str]) -> str:
    """The widest vector feature kvserve's kernels use on a CPU with these flags."""
    if flags & {"amx_int8", "amx_bf16"}:
        return "amx"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return "portable"


def machine_kind(cpuinfo: dict[str, str], kernel_mode: str = "auto") -> str:
    """A short stable slug for a machine's kind from its cpuinfo fields (parse_cpuinfo), e.g.
    "intel-xeon-amx"; kernel_mode is KVSERVE_KERNELS' ("auto" unless held down)."""
    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(cpuinfo.get("vendor_id", ""), "")
    name = cpuinfo.get("model name", "").lower().replace("(r)", " ").replace("(tm)", " ").split()
    words = [vendor or _slug(cpuinfo.get("vendor_id", "")) or "cpu"]
    words += [line for line in PRODUCT_LINES if line in name][:1]
    if vendor == "amd":
        zen = zen_generation(_int(cpuinfo.get("cpu family")), _int(cpuinfo.get("model")))
        words += [zen] if zen else []
    words.append(vector_feature(frozenset(cpuinfo.get("flags", "").split())))
    if kernel_mode != "auto":
        words.append(f"kernels-{kernel_mode}")
    return "-".join(words)


def _int(value: Optional[str]) -> Optional[int]:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def kernel_levels() -> dict[str, str]:
    """The level each compiled kernel runs at here ("torch" where none loads)."""
    from kvserve import kernels
    return {name: (isa if isa is not None and kernels.load(name) is not None else "torch")
            for name in kernels.KERNEL_ISAS for isa in [kernels.best_isa(name)]}


def top_level(levels: dict[str, str]) -> str:
    """The highest of the levels (kernels.ISAS' order), "torch" if no kernel runs."""
    from kvserve.kernels import ISAS
    order = list(ISAS)
    running = [level for level in levels.values() if level in ISAS]
    return max(running, key=order.index) if running else "torch"


def load_average() -> Optional[list[float]]:
    """/proc/loadavg's 1, 5 and 15-minute figures: how quiet the machine was."""
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Machine:
    kind: str
    cpu_model: str
    flags: tuple[str, ...]  # those of FLAGS_THAT_MATTER the CPU has
    kernel_level: str  # the highest level a compiled kernel runs at here
    kernel_levels: dict[str, str]
    cores: int  # logical CPUs the process may run on
    threads: int  # the benchmark's threads
    torch: str
    python: str

    @classmethod
    def here(cls, threads: int, cpuinfo_text: Optional[str] = None) -> "Machine":
        import torch

        from kvserve.config import env_kernel_mode
        if cpuinfo_text is None:
            try:
                with open("/proc/cpuinfo") as f:
                    cpuinfo_text = f.read()
            except OSError:
                cpuinfo_text = ""
        info = parse_cpuinfo(cpuinfo_text)
        flags = frozenset(info.get("flags", "").split())
        levels = kernel_levels()
        return cls(kind=machine_kind(info, env_kernel_mode()), cpu_model=info.get("model name", platform.processor()),
                   flags=tuple(f for f in FLAGS_THAT_MATTER if f in flags), kernel_level=top_level(levels),
                   kernel_levels=levels, cores=len(os.sched_getaffinity(0)), threads=threads,
                   torch=torch.__version__, python=platform.python_version())

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
