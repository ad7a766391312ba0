"""A layer's small steps in one call each (kernels/csrc/layer_ops.cpp) give what the torch ops
they replace give: RMSNorm, RoPE's rotation of halves, silu(gate) * up and the cache write, in
fp32 (to summation order and the last ulp of exp) and bf16 (the same roundings), on strided views
of a fused product's columns as the model hands them over."""

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.backend import rotate_halves
from tests.conftest import compiled_kernel, kernel_isas


@pytest.fixture(scope="module", params=kernel_isas("layer_ops"))
def ops(request):
    module = compiled_kernel("layer_ops", request.param)
    assert module.isa() == request.param
    return module


def torch_rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm(ops, dtype, tol, rows):
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 1000, generator=g).to(dtype)
    x = wide[:, 100:676]  # a strided view, as a fused product's columns are
    w = torch.randn(576, generator=g).to(dtype)
    got, want = ops.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    if dtype == torch.bfloat16:  # a differing sum order can round one ulp the other way, rarely
        assert (got != want).float().mean() < 0.02


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 0)])
def test_rotate_halves(ops, dtype, tol):
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(5, 960, generator=g).to(dtype)
    q = fused[:, :576].view(5, 9, 64)
    angles = torch.rand(5, 32, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got, want = ops.rotate_halves(q, cos, sin), rotate_halves(q, cos, sin)
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1536, 1000, 7])
def test_silu_mul(ops, dtype, width):
    """silu(gate) * up as torch rounds it: fp32 to the last ulps of exp, bf16 and fp16 to the same
    roundings (an exp one ulp off can move a rounding, rarely); gates from -100 to 100, where
    exp(-gate) overflows, on strided views with widths off the vector length."""
    g = torch.Generator().manual_seed(width)
    gu = (torch.randn(5, 2 * width, generator=g) * 4)
    gu[0, :width] = torch.linspace(-100, 100, width)
    gu = gu.to(dtype)
    gate, up = gu[:, :width], gu[:, width:]
    got, want = ops.silu_mul(gate, up), F.silu(gate) * up
    assert got.dtype == dtype and got.shape == want.shape and torch.isfinite(got).all()
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    else:
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
        assert ((got.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-6).all()
        assert (got != want).float().mean() < 0.02


def test_store_kv(ops):
    kc, vc = torch.zeros(8, 16, 3, 64), torch.zeros(8, 16, 3, 64)
    kv = torch.randn(3, 960)
    k, v = kv[:, 576:768].view(3, 3, 64), kv[:, 768:].view(3, 3, 64)
    slots = torch.tensor([5, 17, 127])
    ops.store_kv(kc, vc, slots, k, v)
    assert torch.equal(kc.view(-1, 3, 64)[slots], k) and torch.equal(vc.view(-1, 3, 64)[slots], v)
    assert kc.view(-1, 3, 64).abs().sum(dim=(1, 2)).count_nonzero() == 3
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.store_kv(kc, vc, torch.tensor([128, 0, 1]), k, v)
