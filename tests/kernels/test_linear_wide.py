"""The 16-bit weight kernel (kernels/csrc/linear_wide.cpp) on every code path this CPU runs
(portable always; AVX2 and AVX-512 where present): fp16 and bf16 weights widen to fp32 bit for
bit as torch widens them, and products equal `x @ W.float().T (+ b)` within fp32 summation
error, for odd shapes (K off multiples of 8, 16 and 32; N odd), 1 to 8 rows and more, with and
without bias, on 1 and 2 threads."""

import pytest
import torch

from kvserve.models.packed import WIDE_FORMATS, dequantize_torch, keep_wide
from tests.conftest import compiled_kernel, kernel_isas, scaled_rows, torch_threads

ISAS = kernel_isas("linear_wide")
DTYPES = [torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (7, 5), (37, 33), (33, 100), (192, 576), (577, 1536)]


def weight(n, k, dtype, seed=0):
    return scaled_rows(n, k, seed).to(dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_is_torchs_widening_bit_for_bit(isa, dtype):
    kernel = compiled_kernel("linear_wide", isa)
    assert kernel.isa() == isa
    w = weight(37, 101, dtype)
    w[0, :6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-7, -6e-8]).to(dtype)  # subnormals too
    p = keep_wide(w)
    assert p.data.dtype == torch.uint8 and p.data.shape == (37, 202) and p.fmt is WIDE_FORMATS[dtype]
    got = kernel.dequantize(p.data, p.fmt.ggml_type, 101)
    assert torch.equal(got, w.float()) and torch.equal(dequantize_torch(p.data, p.fmt, 101), w.float())
    assert torch.equal(got.view(torch.int32), w.float().view(torch.int32))  # signed zeros kept
    for out in DTYPES:  # straight into a 16-bit dtype: rounded as .to() rounds
        assert torch.equal(kernel.dequantize(p.data, p.fmt.ggml_type, 101, str(out).removeprefix("torch.")),
                           w.float().to(out))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_products_equal_the_fp32_cast_product(isa, dtype, n, k, threads):
    kernel = compiled_kernel("linear_wide", isa)
    w = weight(n, k, dtype, seed=n + k)
    p = keep_wide(w)
    wf = w.double()
    g = torch.Generator().manual_seed(1)
    with torch_threads(threads):
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17):
            x = torch.randn(m, k, generator=g)
            bias = torch.randn(n, generator=g) if m % 2 else None
            y = kernel.linear_quant(x, p.data, p.fmt.ggml_type, k, bias)
            ref = x.double() @ wf.T + (bias.double() if bias is not None else 0)
            cast = x @ w.float().T + (bias if bias is not None else 0)  # the fp32 cast path
            bound = (x.double().abs() @ wf.abs().T) * k * 2 ** -24 + 1e-30  # fp32 sums in another order
            slack = bias.double().abs() * 2 ** -23 if bias is not None else 0
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert ((y.double() - ref).abs() <= bound + slack).all()
            assert torch.allclose(y, cast, rtol=1e-5, atol=1e-5 * cast.abs().max().item())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_one_hot_row_gives_each_weight_exactly(isa, dtype):
    """x = e_i picks column i of W: one product by 1, so y is the widened weight bit for bit,
    on the vector steps and on the tail."""
    kernel = compiled_kernel("linear_wide", isa)
    n, k = 19, 45
    w = weight(n, k, dtype, seed=3)
    p = keep_wide(w)
    for i in (0, 7, 8, 15, 16, 31, 32, 40, 44):
        x = torch.zeros(1, k)
        x[0, i] = 1.0
        assert torch.equal(kernel.linear_quant(x, p.data, p.fmt.ggml_type, k, None)[0], w[:, i].float()), i


def test_wrong_shapes_and_formats_are_refused():
    kernel = compiled_kernel("linear_wide", "portable")
    p = keep_wide(weight(4, 8, torch.float16))
    with pytest.raises(RuntimeError, match="F16"):
        kernel.linear_quant(torch.randn(1, 8), p.data, 8, 8, None)
    with pytest.raises(RuntimeError, match="16-bit weights"):
        kernel.linear_quant(torch.randn(1, 9), p.data, 1, 9, None)
    with pytest.raises(RuntimeError, match="x: fp32"):
        kernel.linear_quant(torch.randn(1, 8, dtype=torch.float64), p.data, 1, 8, None)
