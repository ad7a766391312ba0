"""How a compiled kernel's code path is chosen: by this CPU's flags at run time, held down or
turned off by KVSERVE_KERNELS, and never above what the CPU runs."""

import pytest

from kvserve import kernels
from kvserve.models import linear


@pytest.fixture(autouse=True)
def auto_mode(monkeypatch):
    """These tests set the mode themselves, whatever the suite runs under."""
    monkeypatch.setenv("KVSERVE_KERNELS", "auto")


def test_portable_is_always_supported_and_first():
    for name, levels in kernels.KERNEL_ISAS.items():
        supported = kernels.supported_isas(name)
        assert supported[0] == "portable" and set(supported) <= set(levels)


def test_levels_follow_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse2", "avx2", "fma"}))
    assert kernels.supported_isas("paged_attention") == ["portable"]  # no f16c
    monkeypatch.setattr(kernels, "cpu_flags", lambda: kernels.ISAS["avx2"].cpu_flags)
    assert kernels.best_isa("paged_attention") == "avx2" and kernels.supported_isas("linear_bf16") == ["portable"]
    monkeypatch.setattr(kernels, "cpu_flags", lambda: kernels.ISAS["avx512"].cpu_flags)
    assert kernels.supported_isas("paged_attention") == ["portable", "avx2", "avx512"]
    assert kernels.supported_isas("linear_bf16") == ["portable"]  # no avx512_bf16 flag
    monkeypatch.setattr(kernels, "cpu_flags", lambda: kernels.ISAS["avx512_bf16"].cpu_flags)
    assert kernels.best_isa("linear_bf16") == "avx512_bf16"


def test_a_level_the_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset())
    with pytest.raises(ValueError, match="no 'avx512' path this CPU runs"):
        kernels.load("paged_attention", "avx512")


def test_environment_holds_kernels_down_or_off(monkeypatch):
    monkeypatch.setenv("KVSERVE_KERNELS", "portable")
    assert kernels.best_isa("paged_attention") == kernels.best_isa("linear_bf16") == "portable"
    monkeypatch.setenv("KVSERVE_KERNELS", "off")
    assert kernels.best_isa("paged_attention") is None and kernels.load("paged_attention") is None
    assert "turned off" in kernels.failure("paged_attention")
    assert linear.kernel_for("auto") is None
    with pytest.raises(ValueError, match="linear backend 'cpu-kernel' is unavailable: compiled kernels are turned off"):
        linear.kernel_for("cpu-kernel")
    monkeypatch.setenv("KVSERVE_KERNELS", "fast")
    with pytest.raises(ValueError, match="KVSERVE_KERNELS must be one of"):
        kernels.best_isa("paged_attention")


def test_auto_takes_the_linear_kernel_only_on_its_fast_path(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: kernels.ISAS["avx512"].cpu_flags)
    assert linear.kernel_for("torch") is None
    assert linear.kernel_for("auto") is None  # portable only here: slower than the stock GEMM
