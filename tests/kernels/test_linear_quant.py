"""The packed-weight kernel (kernels/csrc/linear_quant.cpp) on every code path this CPU runs
(portable always; AVX2 and AVX-512 where present): its dequantization is bit-equal to the
reference (torch, and the GGUF reader's numpy path on the model file's own bytes), and its
products equal dequantize-then-multiply within fp32 summation error, for odd shapes and 1 to 64
rows. quantize() packs as the formats define, within half a step of each block's scale (Q4_0:
one step at its clamped end)."""

import pytest
import torch

from kvserve.models.packed import FORMATS, PackedWeight, dequantize_torch, quantize
from tests.conftest import compiled_kernel, kernel_isas, scaled_rows, torch_threads

ISAS = kernel_isas("linear_quant")
FMTS = sorted(f for f in FORMATS if FORMATS[f].kernel == "linear_quant")  # the others: test_kquants.py


def packed(n, k, fmt, seed=0):
    return quantize(scaled_rows(n, k, seed), FORMATS[fmt])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_is_bit_equal_to_the_reference(isa, fmt):
    kernel = compiled_kernel("linear_quant", isa)
    assert kernel.isa() == isa
    p = packed(37, 96, fmt)
    assert torch.equal(kernel.dequantize(p.data, p.fmt.ggml_type, 96), dequantize_torch(p.data, p.fmt, 96))
    for dtype in (torch.bfloat16, torch.float16):  # straight into the dtype: rounded once, as .to() rounds
        got = kernel.dequantize(p.data, p.fmt.ggml_type, 96, str(dtype).removeprefix("torch."))
        assert got.dtype == dtype and torch.equal(got, dequantize_torch(p.data, p.fmt, 96).to(dtype))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n, k", [(1, 32), (37, 96), (192, 576), (576, 1536)])
def test_products_equal_dequantize_then_multiply(isa, fmt, n, k):
    kernel = compiled_kernel("linear_quant", isa)
    p = packed(n, k, fmt, seed=n + k)
    w = dequantize_torch(p.data, p.fmt, k).double()
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 4, 5, 7, 8, 17, 64):
        x = torch.randn(m, k, generator=g)
        bias = torch.randn(n, generator=g) if m % 2 else None
        y = kernel.linear_quant(x, p.data, p.fmt.ggml_type, k, bias)
        ref = x.double() @ w.T + (bias.double() if bias is not None else 0)
        # fp32 sums in another order: within k ulps of the sum of |products|
        bound = (x.double().abs() @ w.abs().T) * k * 2 ** -24 + 1e-30
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert ((y.double() - ref).abs() <= bound + (bias.double().abs() * 2 ** -23 if bias is not None else 0)).all()


# fp16 scales across the range: subnormal, tiny, one, the largest, of both signs
HALVES = torch.tensor([0x0001, 0x03FF, 0x0400, 0x1234, 0x3C00, 0x5A5A, 0x7BFF, 0x8001, 0x83FF, 0xBC00, 0xFBFF, 0x0000],
                      dtype=torch.int32).to(torch.int16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FMTS)
def test_a_one_hot_row_gives_each_weight_exactly(isa, fmt):
    """x = e_i picks column i of W: one product by 1 and sums of zeros, so y equals the
    reference's dequantized weight bit for bit, whatever the scales (d and m converted from
    fp16 by the vector units: subnormal, tiny, huge)."""
    kernel = compiled_kernel("linear_quant", isa)
    n, k = 40, 96
    p = packed(n, k, fmt, seed=7)
    g = torch.Generator().manual_seed(8)
    blocks = p.data.clone().view(n, k // 32, -1)
    heads = HALVES[torch.randint(0, len(HALVES), (n, k // 32, 2), generator=g)].view(torch.uint8).view(n, k // 32, 4)
    blocks[..., :2] = heads[..., :2]
    if fmt == "q4_1":
        blocks[..., 2:4] = heads[..., 2:4]
    data = blocks.reshape(n, -1).contiguous()
    w = dequantize_torch(data, p.fmt, k)
    for i in (0, 5, 16, 31, 47, 95):
        x = torch.zeros(1, k)
        x[0, i] = 1.0
        assert torch.equal(kernel.linear_quant(x, data, p.fmt.ggml_type, k, None)[0], w[:, i]), i


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FMTS)
def test_two_threads_give_the_products_of_one(isa, fmt):
    """Rows of W split over threads change nothing: 2 threads give 1 thread's products bit for bit."""
    kernel = compiled_kernel("linear_quant", isa)
    g = torch.Generator().manual_seed(6)
    for n, k in [(1000, 576), (17, 1536)]:
        p = packed(n, k, fmt, seed=n)
        for m in (1, 2, 3, 4, 5, 8):
            x = torch.randn(m, k, generator=g)
            ys = []
            for threads in (1, 2):
                with torch_threads(threads):
                    ys.append(kernel.linear_quant(x, p.data, p.fmt.ggml_type, k, None))
            assert torch.equal(ys[0], ys[1]), (n, k, m)


@pytest.mark.parametrize("isa", ISAS)
def test_the_model_files_own_bytes(isa, smollm2_path):
    """Q4_1 projections and the Q8_0 embedding of SmolLM2's GGUF, dequantized by the kernel,
    equal the GGUF reader's numpy dequantization bit for bit."""
    from kvserve.models.loaders.gguf_file import GGUFFile
    kernel = compiled_kernel("linear_quant", isa)
    f = GGUFFile(smollm2_path)
    for t in f.tensors:
        if t.name not in ("blk.3.ffn_down.weight", "blk.0.attn_k.weight", "token_embd.weight"):
            continue
        n, k = t.shape
        raw = torch.frombuffer(bytearray(f.data[t.offset:t.offset + t.nbytes]), dtype=torch.uint8).reshape(n, -1)
        rows = raw[:512] if n > 512 else raw
        got = kernel.dequantize(rows.contiguous(), t.ggml_type, k)
        assert torch.equal(got, f.dequantize(t)[:rows.shape[0]])


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_is_within_half_a_step(fmt):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) * 0.05
    p = quantize(w, FORMATS[fmt])
    back = dequantize_torch(p.data, p.fmt, 256)
    blocks, err = w.reshape(64, 8, 32), (back - w).reshape(64, 8, 32).abs()
    span = blocks.amax(-1) - blocks.amin(-1) if fmt == "q4_1" else blocks.abs().amax(-1)
    step = span / {"q8_0": 127, "q4_1": 15, "q4_0": 8}[fmt]
    # Q4_0's 16 levels run from -8 to 7 steps: the end opposite the largest |w| is clamped there,
    # up to one step off (as llama.cpp's reference quantizer does)
    bound = step * (1.0 if fmt == "q4_0" else 0.5)
    assert (err <= bound.unsqueeze(-1) * 1.01 + 1e-7).all()
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.zeros(4, 40), FORMATS[fmt])
    with pytest.raises(ValueError, match="does not hold it"):
        PackedWeight(FORMATS[fmt], p.data[:, :-1], (64, 256))
