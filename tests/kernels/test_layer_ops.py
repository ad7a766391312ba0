"""A layer's small steps in one call each (kernels/csrc/layer_ops.cpp) give what the torch ops
they replace give: RMSNorm, RoPE's rotation of halves, silu(gate) * up and the cache write, in
fp32 (to summation order and the last ulp of exp) and bf16 (the same roundings), on strided views
of a fused product's columns as the model hands them over."""

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.backend import rotate_halves
from kvserve.kv.quant import quantize_int8
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


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_add_rms_norm_adds_in_place_then_normalizes(ops, dtype, tol, rows):
    """residual += x rounds as torch's add (bit for bit), then the norm of the sum as rms_norm."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1000, generator=g).to(dtype)[:, 100:676]  # a strided view
    residual = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    total = residual + x
    got = ops.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(residual, total)  # updated in place
    assert torch.equal(got, ops.rms_norm(total, w, 1e-5))
    assert torch.allclose(got.float(), torch_rms_norm(total, w, 1e-5).float(), rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="residual"):
        ops.add_rms_norm(x, residual[:, :100], w, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_rope_qkv_rotates_q_and_k_and_hands_v_over(ops, dtype, rows):
    """From a fused q|k|v product (9 query, 3 K/V heads of 64): q and k rotated exactly as
    rotate_halves rotates them, v a view of the product's last columns."""
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 15 * 64, generator=g).to(dtype)
    angles = torch.rand(rows, 32, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q, k, v = ops.rope_qkv(qkv, cos, sin, 9, 3)
    assert q.shape == (rows, 9, 64) and k.shape == v.shape == (rows, 3, 64)
    assert torch.equal(q, ops.rotate_halves(qkv[:, :576].view(rows, 9, 64), cos, sin))
    assert torch.equal(k, ops.rotate_halves(qkv[:, 576:768].view(rows, 3, 64), cos, sin))
    assert torch.equal(v, qkv[:, 768:].view(rows, 3, 64)) and v.data_ptr() == qkv[:, 768:].data_ptr()
    with pytest.raises(RuntimeError, match="qkv"):
        ops.rope_qkv(qkv[:, :-64], cos, sin, 9, 3)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1536, 37])
def test_silu_mul_halves_is_silu_mul_of_the_two_halves(ops, dtype, width):
    """The halves read in place equal silu_mul of the two views, also where gu's rows lie further
    apart than its width (a view of a wider tensor) and where the width is no multiple of 16."""
    wide = (torch.randn(3, 2 * width + 5, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    for gu in (wide[:, :2 * width].contiguous(), wide[:, :2 * width]):
        got = ops.silu_mul_halves(gu)
        assert got.shape == (3, width) and got.is_contiguous()
        assert torch.equal(got, ops.silu_mul(gu[:, :width], gu[:, width:]))
    assert ops.silu_mul_halves(wide[:0, :2 * width]).shape == (0, width)
    with pytest.raises(RuntimeError, match="gate"):
        ops.silu_mul_halves(wide[:, :7])


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


def test_store_kv_rounds_fp32_into_a_bf16_cache_as_torch_does(ops):
    """fp32 rows into a bf16 cache: rounded to nearest even as .to(torch.bfloat16) rounds, ties
    (a value halfway between two bf16 values, either way), infinities and NaN included."""
    kc, vc = torch.zeros(8, 16, 3, 64, dtype=torch.bfloat16), torch.zeros(8, 16, 3, 64, dtype=torch.bfloat16)
    k, v = torch.randn(5, 3, 64) * 100, torch.randn(5, 3, 64)
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0x00008000]).to(torch.int32)  # bit patterns
    k.view(-1)[:5] = ties.view(torch.float32)  # 1 + 2^-8 (down to even), 1 + 3 * 2^-8 (up), -1 - 2^-8, max, subnormal
    k.view(-1)[5:8] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    slots = torch.tensor([3, 40, 41, 100, 127])
    ops.store_kv(kc, vc, slots, k, v)
    got, want = kc.view(-1, 3, 64)[slots], k.to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])
    assert got.isnan().equal(want.isnan())
    assert torch.equal(vc.view(-1, 3, 64)[slots], v.to(torch.bfloat16))


def test_store_kv_converts_other_dtypes_and_layouts_as_torch_does(ops):
    """What the torch write does (.to(the cache's dtype), then index_put_) for rows of another
    float dtype (fp16 into bf16, bf16 into fp32, K and V of different dtypes) or another layout
    (heads not contiguous); rows that are not floats are refused by name."""
    slots = torch.tensor([3, 40, 41, 100, 127])
    g = torch.Generator().manual_seed(0)
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    cases = [(bf16, f16, f16, False), (f32, bf16, bf16, False), (f32, f32, f32, True), (bf16, f32, f32, True),
             (bf16, f32, bf16, False), (f16, bf16, f32, True)]  # cache, k, v dtypes; heads strided
    for cache_dtype, k_dtype, v_dtype, strided in cases:
        kc, vc = (torch.zeros(8, 16, 3, 64, dtype=cache_dtype) for _ in range(2))
        k, v = (torch.randn(5, 64, 3, generator=g).transpose(1, 2) if strided
                else torch.randn(5, 3, 64, generator=g) for _ in range(2))
        k, v = k.to(k_dtype), v.to(v_dtype)
        assert k.stride(2) != 1 if strided else k.is_contiguous()
        ops.store_kv(kc, vc, slots, k, v)
        case = (cache_dtype, k_dtype, v_dtype, strided)
        assert torch.equal(kc.view(-1, 3, 64)[slots], k.to(cache_dtype)), case
        assert torch.equal(vc.view(-1, 3, 64)[slots], v.to(cache_dtype)), case
    kc, vc = torch.zeros(8, 16, 3, 64), torch.zeros(8, 16, 3, 64)
    with pytest.raises(RuntimeError, match="floating dtype"):
        ints = torch.ones(5, 3, 64, dtype=torch.int32)
        ops.store_kv(kc, vc, slots, ints, ints)


def torch_int8_write(kc, ks, vc, vs, slots, k, v):
    """Int8KVStorage's torch write: quantize_int8, then the values and the scales put in."""
    for c, sc, x in ((kc, ks, k), (vc, vs, v)):
        q, scale = quantize_int8(x)
        c.view(-1, *q.shape[1:]).index_put_((slots,), q)
        sc.view(-1, scale.shape[1]).index_put_((slots,), scale)


def int8_cache(heads=3, dim=64):
    return (torch.zeros(8, 16, heads, dim, dtype=torch.int8), torch.zeros(8, 16, heads),
            torch.zeros(8, 16, heads, dim, dtype=torch.int8), torch.zeros(8, 16, heads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 40])
def test_store_kv_int8_is_the_torch_write_bit_for_bit(ops, dtype, dim):
    """Values and scales equal quantize_int8's and index_put_'s: halves rounded to even (a row
    whose scale is 1 holding 2.5, 3.5, -2.5), all-zero rows (the smallest scale), rows far from 1,
    heads not contiguous, head dims not a multiple of 16; slots elsewhere stay untouched."""
    g = torch.Generator().manual_seed(dim)
    slots = torch.tensor([3, 40, 41, 100, 127, 7])
    k = torch.randn(6, dim, 3, generator=g).transpose(1, 2).to(dtype)  # heads strided
    v = (torch.randn(6, 3, dim, generator=g) * 1e3).to(dtype)
    k[0, 0] = 0  # an all-zero head row
    v[1, 2] *= 1e-6
    k[2, 1] = 0
    k[2, 1, :5] = torch.tensor([127.0, 2.5, 3.5, -2.5, -126.5])  # scale exactly 1: ties
    mine, want = int8_cache(3, dim), int8_cache(3, dim)
    ops.store_kv_int8(*mine, slots, k, v)
    torch_int8_write(*want, slots, k, v)
    for got, expected in zip(mine, want):
        assert torch.equal(got, expected)
    assert mine[0].view(-1, 3, dim)[41, 1, :5].tolist() == [127, 2, 4, -2, -126]
    assert mine[1].view(-1, 3)[3, 0] == torch.tensor(1e-8, dtype=torch.float32)
    untouched = torch.ones(128, dtype=torch.bool)
    untouched[slots] = False
    assert mine[0].view(-1, 3, dim)[untouched].count_nonzero() == 0


def test_store_kv_int8_non_finite_rows_give_the_same_codes_in_every_build(ops):
    """A row holding an infinity gets an infinite scale, one holding a NaN a NaN scale (torch's
    amax gives both); a NaN quotient is stored as 0 in every build (not the platform's conversion
    of NaN, which may be -128), so every code stays in [-127, 127]. No tokens: nothing written."""
    kc, ks, vc, vs = int8_cache()
    k, v = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    k[0, 1, 5], k[1, 2, 7], v[1, 0, 3] = float("inf"), float("nan"), -float("inf")
    ops.store_kv_int8(kc, ks, vc, vs, torch.tensor([4, 9]), k, v)
    kq, vq = kc.view(-1, 3, 64), vc.view(-1, 3, 64)
    k_scales, v_scales = ks.view(-1, 3), vs.view(-1, 3)
    assert k_scales[4, 1] == float("inf") and k_scales[9, 2].isnan() and v_scales[9, 0] == float("inf")
    inf_row = kq[4, 1].tolist()
    assert inf_row[5] == 0 and inf_row.count(0) == 64  # finite / inf rounds to 0; inf / inf is NaN: 0
    assert kq[9, 2].count_nonzero() == 0 and vq[9, 0].count_nonzero() == 0
    assert torch.equal(kq[4, 0], quantize_int8(k[0, 0])[0])  # the finite heads as torch quantizes them
    assert int(kc.min()) >= -127 and int(vc.min()) >= -127
    before = [t.clone() for t in (kc, ks, vc, vs)]
    ops.store_kv_int8(kc, ks, vc, vs, torch.tensor([], dtype=torch.long), k[:0], v[:0])
    after = (kc, ks, vc, vs)  # compared as bytes: the scales hold a NaN
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after))


def test_store_kv_int8_refuses_what_it_cannot_write(ops):
    kc, ks, vc, vs = int8_cache()
    k = torch.randn(2, 3, 64)
    for slots in ([0, 128], [-1, 0]):
        with pytest.raises(RuntimeError, match="outside the cache"):
            ops.store_kv_int8(kc, ks, vc, vs, torch.tensor(slots), k, k)
    with pytest.raises(RuntimeError, match="int64 CPU slots"):
        ops.store_kv_int8(kc, ks, vc, vs, torch.tensor([0, 1], dtype=torch.int32), k, k)
    with pytest.raises(RuntimeError, match="fp32 scales"):
        two_heads = ks[..., :2].contiguous()
        ops.store_kv_int8(kc, two_heads, vc, two_heads, torch.tensor([0, 1]), k, k)
    with pytest.raises(RuntimeError, match="int8 CPU caches"):
        ops.store_kv_int8(kc.transpose(0, 1), ks, vc.transpose(0, 1), vs, torch.tensor([0, 1]), k, k)
    with pytest.raises(RuntimeError, match="int8 CPU caches"):
        ops.store_kv_int8(kc.float(), ks, vc.float(), vs, torch.tensor([0, 1]), k, k)
    with pytest.raises(RuntimeError, match="fp32 scales"):
        ops.store_kv_int8(kc, ks.half(), vc, vs.half(), torch.tensor([0, 1]), k, k)
    with pytest.raises(RuntimeError, match="floating dtype"):
        ops.store_kv_int8(kc, ks, vc, vs, torch.tensor([0, 1]), k.int(), k.int())


def test_argmax_rows_is_torchs_max_indices(ops):
    """The AVX-512 build's argmax_rows equals x.max(-1).indices: the first of tied maxima (within a
    lane, across lanes and in the tail past the last 16), a NaN the largest (its first), -inf
    rows, rows shorter than 16 and rows of a wider tensor; the other builds do not define it."""
    if ops.isa() != "avx512":
        assert not hasattr(ops, "argmax_rows")
        return
    g = torch.Generator().manual_seed(0)
    for V in (1, 5, 16, 17, 31, 49152, 49155):
        x = torch.randn(9, V, generator=g)
        x[1] = 3.0  # every value tied
        x[2, V // 2:] = 7.0  # ties from the middle on
        x[3, -1] = 99.0  # the largest last (in the tail when V % 16)
        x[4, V // 3] = float("nan")
        x[4, -1] = float("nan")  # two NaNs: the first
        x[5] = float("-inf")
        x[6, 0] = float("nan")
        x[7, (V - 1) // 16 * 16:] = 50.0  # ties that start at the last whole vector or the tail
        for rows in (x, torch.randn(9, V + 7, generator=g)[:, :V]):  # contiguous rows, and rows of a wider tensor
            assert torch.equal(ops.argmax_rows(rows), rows.max(-1).indices), V
    with pytest.raises(RuntimeError, match="fp32"):
        ops.argmax_rows(torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match="V > 0"):
        ops.argmax_rows(torch.empty(2, 0))
