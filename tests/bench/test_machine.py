"""The machine kind: a stable slug from cpuinfo text (vendor, product line, AMD's Zen generation
from its family and model numbers, the widest vector feature), and the machine as stored."""

import pytest

from kvserve.bench.machine import Machine, machine_kind, parse_cpuinfo, top_level, zen_generation

XEON_AMX = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: SomethingElse
model name\t: not the first processor
"""

EPYC_GENOA = """vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9B14
flags\t\t: avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16
"""

EPYC_MILAN = """vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: sse2 avx avx2 fma f16c
"""


def test_parse_cpuinfo_reads_the_first_processor_only():
    info = parse_cpuinfo(XEON_AMX)
    assert info["vendor_id"] == "GenuineIntel"
    assert info["model name"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert "amx_int8" in info["flags"].split()


@pytest.mark.parametrize("text, kind", [
    (XEON_AMX, "intel-xeon-amx"),
    (EPYC_GENOA, "amd-epyc-zen4-avx512"),
    (EPYC_MILAN, "amd-epyc-zen3-avx2"),
    ("vendor_id : GenuineIntel\nmodel name : Intel(R) Core(TM) i7-8700\nflags : avx avx2 fma\n", "intel-core-avx2"),
    ("model name : Some ARM board\nflags : fp asimd\n", "cpu-portable"),
])
def test_machine_kind_from_cpuinfo(text, kind):
    assert machine_kind(parse_cpuinfo(text)) == kind


def test_held_down_kernels_are_another_kind():
    assert machine_kind(parse_cpuinfo(EPYC_MILAN), "portable") == "amd-epyc-zen3-avx2-kernels-portable"


@pytest.mark.parametrize("family, model, generation", [
    (0x17, 0x01, "zen"), (0x17, 0x31, "zen2"), (0x19, 0x01, "zen3"), (0x19, 0x21, "zen3"),
    (0x19, 0x11, "zen4"), (0x19, 0x61, "zen4"), (0x1A, 0x02, "zen5"), (6, 143, None), (None, None, None),
])
def test_zen_generation(family, model, generation):
    assert zen_generation(family, model) == generation


def test_top_level_is_the_highest_running_level():
    assert top_level({"a": "portable", "b": "avx2", "c": "torch"}) == "avx2"
    assert top_level({"a": "avx512_vnni", "b": "avx512"}) == "avx512_vnni"
    assert top_level({"a": "torch"}) == "torch"


def test_machine_here_from_given_cpuinfo():
    from kvserve.config import env_kernel_mode
    m = Machine.here(threads=2, cpuinfo_text=EPYC_GENOA)
    held = "" if env_kernel_mode() == "auto" else f"-kernels-{env_kernel_mode()}"  # KVSERVE_KERNELS joins the kind
    assert m.kind == "amd-epyc-zen4-avx512" + held and m.cpu_model == "AMD EPYC 9B14"
    assert m.flags == ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16")
    assert m.threads == 2 and m.cores >= 1
    import torch
    assert m.as_dict()["torch"] == torch.__version__
