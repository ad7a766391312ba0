"""The int8-activation kernel (kernels/csrc/linear_q8.cpp) on every code path this CPU runs
(portable always, AVX-512 VNNI where present): its interleaved order holds GGUF's bytes and gives
them back; its products equal `linear_q8_reference` (x rounded per 32-block to dx * round(x / dx),
dx = max|x| / 127, times the dequantized weight) within fp32 summation error, for odd shapes,
groups of 16 blocks and their remainders, and 1 to 64 rows; and they are within the derived bound
of dequantize-then-multiply:

    |y - x @ W^T| <= sum over blocks b of (max|x_b| / 254) * sum_{i in b} |w_i|

(each activation moves by at most half its block's step dx / 2 = max|x_b| / 254)."""

import pytest
import torch

from kvserve.models.packed import FORMATS, PackedLinear, PackedLinearQ8, dequantize_torch, linear_q8_reference, quantize
from tests.conftest import compiled_kernel, kernel_isas

ISAS = kernel_isas("linear_q8")
Q4 = ["q4_0", "q4_1"]


def packed(n, k, fmt, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of different scales
    return quantize(w, FORMATS[fmt])


def rounding_bound(x, w):
    """Half a step of each activation's block, times the weights it meets."""
    m, k = x.shape
    step = x.abs().reshape(m, k // 32, 32).amax(-1).double() / 254  # [m, nb]
    per_block = w.abs().double().reshape(w.shape[0], k // 32, 32).sum(-1)  # [n, nb]
    return step @ per_block.T


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", Q4)
@pytest.mark.parametrize("k", [32, 96, 512, 576, 1536, 800])
def test_interleaving_keeps_the_bytes(isa, fmt, k):
    kernel = compiled_kernel("linear_q8", isa)
    assert kernel.isa() == isa
    p = packed(7, k, fmt)
    inter = kernel.interleave(p.data, p.fmt.ggml_type, k)
    assert inter.shape == p.data.shape and not torch.equal(inter, p.data)
    assert torch.equal(inter.sort(dim=1).values, p.data.sort(dim=1).values)  # the same bytes a row
    assert torch.equal(kernel.deinterleave(inter, p.fmt.ggml_type, k), p.data)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", Q4)
@pytest.mark.parametrize("n, k", [(1, 32), (37, 96), (192, 576), (576, 1536), (33, 800)])
def test_products_equal_the_reference(isa, fmt, n, k):
    kernel = compiled_kernel("linear_q8", isa)
    p = packed(n, k, fmt, seed=n + k)
    inter = kernel.interleave(p.data, p.fmt.ggml_type, k)
    w = dequantize_torch(p.data, p.fmt, k)
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 4, 5, 7, 8, 17, 64):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g)
        x[0, :32] = 0  # a block of zeros: dx = 0
        bias = torch.randn(n, generator=g) if m % 2 else None
        y = kernel.linear_q8(x, inter, p.fmt.ggml_type, k, bias)
        assert y.shape == (m, n) and y.dtype == torch.float32
        ref = linear_q8_reference(x, p) + (bias.double() if bias is not None else 0)
        # the integer sums are exact; the float ones in another order: k ulps of the magnitudes
        bound = (x.double().abs() @ w.double().abs().T) * k * 2 ** -23 + 1e-30
        assert ((y.double() - ref).abs() <= bound + (bias.double().abs() * 2 ** -23 if bias is not None else 0)).all()
        exact = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
        assert ((y.double() - exact).abs() <= rounding_bound(x, w) * 1.001 + bound).all()


@pytest.mark.parametrize("isa", ISAS)
def test_the_reference_rounds_as_described(isa):
    """linear_q8_reference against a hand-rounded activation: x = [127, -63.4, 0.6, ...] has dx = 1."""
    p = packed(5, 32, "q4_1")
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([127.0, -63.4, 0.6])
    rounded = torch.zeros(1, 32)
    rounded[0, :3] = torch.tensor([127.0, -63.0, 1.0])
    w = dequantize_torch(p.data, p.fmt, 32).double()
    assert torch.allclose(linear_q8_reference(x, p), rounded.double() @ w.T)
    kernel = compiled_kernel("linear_q8", isa)
    y = kernel.linear_q8(x, kernel.interleave(p.data, p.fmt.ggml_type, 32), p.fmt.ggml_type, 32, None)
    assert torch.allclose(y.double(), rounded.double() @ w.T, rtol=1e-6, atol=1e-5)


def test_module_takes_many_rows_through_the_dense_gemm():
    """PackedLinearQ8: few rows through the kernel, many (prefill) dequantized exactly."""
    compiled_kernel("linear_q8")
    p = packed(64, 576, "q4_1")
    layer = PackedLinearQ8(PackedLinear(p))
    w = dequantize_torch(p.data, p.fmt, 576)
    x = torch.randn(20, 576)
    assert torch.allclose(layer(x), x @ w.T, rtol=1e-5, atol=1e-4)  # exact but for summation order
    few = layer(x[:3])
    assert torch.allclose(few.double(), linear_q8_reference(x[:3], p), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="not q8_0"):
        PackedLinearQ8(PackedLinear(packed(8, 64, "q8_0")))
