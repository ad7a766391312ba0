"""The int8-activation kernel (kernels/csrc/linear_q8.cpp) for Q4_0, Q4_1 and Q8_0 weights on
every code path this CPU runs (portable always, AVX2, AVX-512 VNNI and AMX where present): its panels
of 16 rows (in groups of two, block by block) hold GGUF's bytes and give them back, all or the rows
an index names; its products equal `linear_q8_reference` (x rounded per 32-block to dx * round(x / dx),
dx = max|x| / 127, times the dequantized weight) within fp32 summation error, for odd shapes,
a last panel of fewer than 16 rows, tiles of four rows and their remainders, 1 to 257 rows (AMX's
tiles of 16 rows and the rows left around its threshold), on 1 and 2 threads;
and they are within the derived bound of dequantize-then-multiply:

    |y - x @ W^T| <= sum over blocks b of (max|x_b| / 254) * sum_{i in b} |w_i|

(each activation moves by at most half its block's step dx / 2 = max|x_b| / 254)."""

import pytest
import torch

from kvserve.models.packed import FORMATS, PackedLinear, PackedLinearQ8, dequantize_torch, linear_q8_reference, quantize
from tests.conftest import compiled_kernel, kernel_isas, scaled_rows, torch_threads

ISAS = kernel_isas("linear_q8")
FMTS = ["q4_0", "q4_1", "q8_0"]
needs_amx = pytest.mark.skipif("amx" not in ISAS, reason="this CPU lacks AMX (amx_tile, amx_int8, amx_bf16 with "
                               "avx512_bf16 and avx512_vnni flags), so kvserve runs no amx build here")


def packed(n, k, fmt, seed=0):
    return quantize(scaled_rows(n, k, seed), FORMATS[fmt])


def rounding_bound(x, w):
    """Half a step of each activation's block, times the weights it meets."""
    m, k = x.shape
    step = x.abs().reshape(m, k // 32, 32).amax(-1).double() / 254  # [m, nb]
    per_block = w.abs().double().reshape(w.shape[0], k // 32, 32).sum(-1)  # [n, nb]
    return step @ per_block.T


def assert_near_reference(y, x, p, w, bias):
    """y is linear_q8_reference (+ bias) up to the order of the float sums, and within the
    rounding bound of the exact product."""
    m, k = x.shape
    assert y.shape == (m, w.shape[0]) and y.dtype == torch.float32
    ref = linear_q8_reference(x, p) + (bias.double() if bias is not None else 0)
    # the integer sums are exact; the float ones in another order: k ulps of the magnitudes
    bound = (x.double().abs() @ w.double().abs().T) * k * 2 ** -23 + 1e-30
    bias_ulp = bias.double().abs() * 2 ** -23 if bias is not None else 0
    assert ((y.double() - ref).abs() <= bound + bias_ulp).all()
    exact = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    assert ((y.double() - exact).abs() <= rounding_bound(x, w) * 1.001 + bound).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n, k", [(7, 32), (16, 96), (33, 576), (48, 1536), (5, 800)])
def test_panels_keep_the_bytes(isa, fmt, n, k):
    kernel = compiled_kernel("linear_q8", isa)
    assert kernel.isa() == isa
    p = packed(n, k, fmt)
    panels = kernel.pack_panels(p.data, p.fmt.ggml_type, k)
    rows = -(-n // 32) * 32  # whole groups of two panels
    assert panels.shape == (rows, p.data.shape[1])
    # the same bytes, and zeros for the padding rows
    assert torch.equal(panels.flatten().sort().values[rows * p.data.shape[1] - p.data.numel():],
                       p.data.flatten().sort().values)
    assert torch.equal(kernel.unpack_panels(panels, p.fmt.ggml_type, k, n), p.data)
    with pytest.raises(RuntimeError, match="panel rows"):
        kernel.linear_q8(torch.randn(1, k), panels, p.fmt.ggml_type, k, n + 32, None)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FMTS)
def test_a_group_of_panels_is_one_run_a_block(isa, fmt):
    """Block b of a group of two panels (32 W rows) lies in one run of 32 * GGUF's block bytes:
    panel 0's weight bytes, panel 1's, the 16 d of each, then the 16 m of each (Q4_1); a group's
    runs follow one another, block by block, then the next group's."""
    kernel = compiled_kernel("linear_q8", isa)
    k, p = 64, packed(64, 64, fmt)
    flat = kernel.pack_panels(p.data, p.fmt.ggml_type, k).flatten()
    nb, bb = k // 32, p.data.shape[1] // (k // 32)  # blocks a row, GGUF's bytes a block
    head, qb = (4 if fmt == "q4_1" else 2), (512 if fmt == "q8_0" else 256)
    for row in (0, 17, 31, 33, 63):
        group, (panel, lane) = row // 32, divmod(row % 32, 16)
        for b in range(nb):
            run = (group * nb + b) * 32 * bb
            gguf = p.data[row, b * bb:(b + 1) * bb]
            assert torch.equal(flat[run + 2 * qb + 32 * panel + 2 * lane:][:2], gguf[:2])  # d
            if fmt == "q4_1":
                assert torch.equal(flat[run + 2 * qb + 64 + 32 * panel + 2 * lane:][:2], gguf[2:4])  # m
            weights = flat[run + qb * panel:][:qb].view(-1, 16, 4)[:, lane].flatten()  # chunks of 64
            assert torch.equal(weights, gguf[head:])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n, k", [(1, 32), (37, 96), (192, 576), (576, 1536), (33, 800), (48, 64)])
def test_products_equal_the_reference(isa, fmt, n, k):
    kernel = compiled_kernel("linear_q8", isa)
    p = packed(n, k, fmt, seed=n + k)
    panels = kernel.pack_panels(p.data, p.fmt.ggml_type, k)
    w = dequantize_torch(p.data, p.fmt, k)
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 17, 64, 200):
        if isa == "portable" and m == 200 and n * k > 100_000:
            continue  # the scalar loop: 64 rows cover its tiles
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g)
        x[0, :32] = 0  # a block of zeros: dx = 0
        bias = torch.randn(n, generator=g) if m % 2 else None
        assert_near_reference(kernel.linear_q8(x, panels, p.fmt.ggml_type, k, n, bias), x, p, w, bias)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n, k", [(49, 32), (49, 576), (577, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_around_the_amx_threshold(isa, fmt, n, k, threads):
    """Row counts below, at and well above where AMX takes over (32 rows, 16 for Q8_0: whole tiles
    of 16 rows on AMX, the rows left on VNNI), odd N (a last panel of one row), bias or not: every
    path's products are the reference's. Past 256 rows a task sweeps a chunk of 256 rows: 257 and
    515 rows end in a chunk of one and of three rows."""
    if isa == "portable" and n * k > 100_000:
        pytest.skip("the scalar loop: the smaller shapes cover its tiles")
    kernel = compiled_kernel("linear_q8", isa)
    p = packed(n, k, fmt, seed=n + k)
    panels = kernel.pack_panels(p.data, p.fmt.ggml_type, k)
    w = dequantize_torch(p.data, p.fmt, k)
    g = torch.Generator().manual_seed(threads)
    for m in (1, 15, 16, 17, 31, 32, 33, 64, 100, 257, 515):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g)
        x[-1, -32:] = 0  # a block of zeros (dx = 0) in the rows left after the tiles
        bias = torch.randn(n, generator=g) if m % 2 else None
        with torch_threads(threads):
            y = kernel.linear_q8(x, panels, p.fmt.ggml_type, k, n, bias)
        assert_near_reference(y, x, p, w, bias)


@needs_amx
@pytest.mark.parametrize("fmt", FMTS)
def test_amx_gives_the_vnni_products(fmt):
    """The AMX path scales each block's integer sums with the VNNI tile's float operations, in
    its order: the same products bit for bit, on 1 and 2 threads, for the tiles of 16 rows and
    the rows left after them."""
    amx, vnni = compiled_kernel("linear_q8", "amx"), compiled_kernel("linear_q8", "avx512_vnni")
    assert amx.isa() == "amx"
    g = torch.Generator().manual_seed(7)
    for n, k in [(577, 1536), (49, 96), (1000, 576)]:
        p = packed(n, k, fmt, seed=n)
        panels = amx.pack_panels(p.data, p.fmt.ggml_type, k)
        for m in (16, 31, 32, 33, 64, 257):
            x = torch.randn(m, k, generator=g)
            bias = torch.randn(n, generator=g) if m % 2 else None
            for threads in (1, 2):
                with torch_threads(threads):
                    y_amx = amx.linear_q8(x, panels, p.fmt.ggml_type, k, n, bias)
                    y_vnni = vnni.linear_q8(x, panels, p.fmt.ggml_type, k, n, bias)
                assert torch.equal(y_amx, y_vnni), (n, k, m, threads)


def test_amx_level_only_where_the_cpu_has_it(monkeypatch):
    """A CPU with AVX-512 VNNI but not all of AMX's int8 and bf16 tiles (and AVX512-BF16) keeps the
    avx512_vnni build; one with all of them takes the amx build (whatever this machine has)."""
    from kvserve import kernels
    monkeypatch.setenv("KVSERVE_KERNELS", "auto")
    vnni_flags = kernels.ISAS["avx512_vnni"].cpu_flags
    monkeypatch.setattr(kernels, "cpu_flags", lambda: vnni_flags)
    assert kernels.best_isa("linear_q8") == "avx512_vnni"
    monkeypatch.setattr(kernels, "cpu_flags", lambda: vnni_flags | {"amx_tile"})
    assert kernels.best_isa("linear_q8") == "avx512_vnni"  # tiles without their products
    monkeypatch.setattr(kernels, "cpu_flags", lambda: vnni_flags | {"amx_tile", "amx_int8", "amx_bf16"})
    assert kernels.best_isa("linear_q8") == "avx512_vnni"  # no AVX512-BF16 to round x and W with
    monkeypatch.setattr(kernels, "cpu_flags", lambda: vnni_flags | {"avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"})
    assert kernels.supported_isas("linear_q8")[-2:] == ["avx512_vnni", "amx"]
    assert kernels.best_isa("linear_q8") == "amx"


def dense_copy_product(x, w, bias):
    """What the dense bf16 copy computes: x and W rounded to bf16, their products summed (here in
    fp64), plus the bias in fp32."""
    y = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T
    return y + (bias.double() if bias is not None else 0)


def assert_near_dense_copy(y, x, w, bias):
    """y is the bf16 copy's product up to the order of its fp32 sums: k ulps of the magnitudes."""
    m, k = x.shape
    assert y.shape == (m, w.shape[0]) and y.dtype == torch.float32
    magnitudes = x.to(torch.bfloat16).double().abs() @ w.to(torch.bfloat16).double().abs().T
    bias_ulp = bias.double().abs() * 2 ** -23 if bias is not None else 0
    assert ((y.double() - dense_copy_product(x, w, bias)).abs() <= magnitudes * k * 2 ** -23 + bias_ulp + 1e-30).all()


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_tiles_only_in_the_amx_build(isa):
    """The bf16 tiles' entry point is in the amx build and no other: callers ask for it by name."""
    assert hasattr(compiled_kernel("linear_q8", isa), "linear_bf16_tiles") == (isa == "amx")


@needs_amx
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n, k", [(49, 32), (49, 576), (577, 1536), (1536, 576), (576, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_tiles_give_the_dense_copys_products(fmt, n, k, threads):
    """linear_bf16_tiles is bf16(x) @ bf16(dequantize(W))^T (+ bias) up to the order of the fp32
    sums: 1 to 257 rows (whole tiles of 16 and the rows left), one or two panels a thread's last
    step, a last panel of one row, bias or not."""
    tiles_near_dense_copy(fmt, n, k, threads, (1, 15, 16, 17, 32, 33, 64, 100, 257), seed=n + k)


def tiles_near_dense_copy(fmt, n, k, threads, rows, seed):
    """linear_bf16_tiles of random x of each row count in `rows` (bias on odd counts), at
    `threads` threads, against the dense bf16 copy's product."""
    kernel = compiled_kernel("linear_q8", "amx")
    p = packed(n, k, fmt, seed=seed)
    panels = kernel.pack_panels(p.data, p.fmt.ggml_type, k)
    w = dequantize_torch(p.data, p.fmt, k)
    g = torch.Generator().manual_seed(threads)
    for m in rows:
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g)
        bias = torch.randn(n, generator=g) if m % 2 else None
        with torch_threads(threads):
            y = kernel.linear_bf16_tiles(x, panels, p.fmt.ggml_type, k, n, bias)
        assert_near_dense_copy(y, x, w, bias)


@needs_amx
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n", [49, 577])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_tiles_over_chunks_of_rows(fmt, n, threads):
    """Past about 1 MiB of bf16 x (320 rows at K = 1536) the rows go in chunks, each chunk times
    every pair of panels: one chunk exactly, one row more, and three chunks and a part whose last
    tile is cut, with one or several pairs of panels a thread."""
    tiles_near_dense_copy(fmt, n, 1536, threads, (320, 321, 1000), seed=n)


def halfway_q4_1(n):
    """Q4_1 rows [n, 20] (K = 32) with d = 2**-8 and m = 1: w = 1 + q / 256, and every odd q lies
    halfway between two bf16 values (their step is 2 / 256 there)."""
    g = torch.Generator().manual_seed(3)
    head = torch.tensor([2 ** -8, 1.0], dtype=torch.float16).view(torch.uint8)  # d, m
    qs = torch.randint(0, 256, (n, 16), generator=g, dtype=torch.uint8)
    return torch.cat([head.expand(n, 4), qs], dim=1).contiguous()


@needs_amx
@pytest.mark.parametrize("fmt", FMTS + ["halfway"])
def test_bf16_tiles_round_as_torch(fmt):
    """x and the dequantized weights are rounded to bf16 exactly as torch's .to(torch.bfloat16)
    (to nearest, ties to even): rows of the identity as x give the rounded weights bit for bit,
    and the identity as W (Q8_0, d = 1) gives the rounded x, ties included."""
    kernel = compiled_kernel("linear_q8", "amx")
    if fmt == "halfway":
        data, qfmt = halfway_q4_1(40), FORMATS["q4_1"]
    else:
        p = packed(40, 64, fmt, seed=11)
        data, qfmt = p.data, p.fmt
    k = data.shape[1] // qfmt.block_bytes * 32
    w = dequantize_torch(data, qfmt, k)
    y = kernel.linear_bf16_tiles(torch.eye(k), kernel.pack_panels(data, qfmt.ggml_type, k), qfmt.ggml_type, k, 40, None)
    assert torch.equal(y, w.to(torch.bfloat16).float().T)
    if fmt == "halfway":
        assert (w.to(torch.bfloat16).float() != w).any()  # ties were rounded
    eye = torch.cat([torch.ones(32, 1, dtype=torch.float16).view(torch.uint8), torch.eye(32, dtype=torch.uint8)], dim=1)
    x = torch.randn(33, 32) * 10.0 ** torch.randint(-30, 30, (33, 1))
    x[0] = 1 + (2 * torch.arange(32) + 1) * 2.0 ** -8  # halfway between two bf16 values each
    y = kernel.linear_bf16_tiles(x, kernel.pack_panels(eye, FORMATS["q8_0"].ggml_type, 32), FORMATS["q8_0"].ggml_type, 32, 32, None)
    assert torch.equal(y, x.to(torch.bfloat16).float())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FMTS)
def test_threads_give_the_products_of_one(isa, fmt):
    """The runs of W rows split over threads (each its share, then the runs left in the others'
    as it finishes), tiles of one to four rows and the panels asked for ahead change nothing: 2,
    3 and 5 threads give 1 thread's products bit for bit, call after call, for a last panel of
    fewer than 16 rows, an odd number of panels, 1 to 9 rows (each remainder of four) and 17 (the
    split by single runs). A run no thread took would show as the NaNs freed just before (y is
    uninitialized); one taken twice writes the same values, which the next test catches."""
    kernel = compiled_kernel("linear_q8", isa)
    g = torch.Generator().manual_seed(5)
    for n, k in [(1000, 576), (960, 96), (17, 1536)]:
        p = packed(n, k, fmt, seed=n)
        panels = kernel.pack_panels(p.data, p.fmt.ggml_type, k)
        for m in [*range(1, 10), 17]:
            x = torch.randn(m, k, generator=g)
            with torch_threads(1):
                one = kernel.linear_q8(x, panels, p.fmt.ggml_type, k, n, None)
            for threads in (2, 3, 5):
                with torch_threads(threads):
                    for _ in range(3):
                        torch.full_like(one, float("nan"))  # freed at once: NaNs where y is likely to go
                        assert torch.equal(kernel.linear_q8(x, panels, p.fmt.ggml_type, k, n, None), one), (
                            n, k, m, threads)


@pytest.mark.parametrize("isa", ISAS)
def test_stealing_runs_every_task_once(isa):
    """parallel_stealing (kernels/csrc/parallel_tasks.h), the split linear_q8's threads take their
    runs of W rows by, runs every task exactly once: task counts below, at and past the threads'
    ranges, grains of 1 to 7, 1 to 5 threads; and where the first range's tasks are slow (1 ms
    each), the second thread takes some of them (in one of five tries: a loaded machine may keep
    the second thread off its core for a whole call)."""
    kernel = compiled_kernel("linear_q8", isa)
    for threads in (1, 2, 3, 5):
        with torch_threads(threads):
            for n in (0, 1, 2, 3, 5, 8, 17, 64, 1000):
                for grain in (1, 3, 4, 7):
                    runs, _ = kernel.stealing_runs(n, grain, 0.0)
                    assert torch.equal(runs, torch.ones(n, dtype=torch.long)), (threads, n, grain)
    taken = []
    with torch_threads(2):
        for _ in range(5):
            runs, elsewhere = kernel.stealing_runs(64, 1, 1000.0)
            assert torch.equal(runs, torch.ones(64, dtype=torch.long))
            taken.append(elsewhere.item())
            if taken[-1] > 0:
                break
    assert taken[-1] > 0, taken


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
    y = kernel.linear_q8(x, kernel.pack_panels(p.data, p.fmt.ggml_type, 32), p.fmt.ggml_type, 32, 5, None)
    assert torch.allclose(y.double(), rounded.double() @ w.T, rtol=1e-6, atol=1e-5)


def test_module_takes_every_row_count_through_the_kernel():
    """PackedLinearQ8: one row or many (prefill), leading dimensions, bf16 activations, all the
    kernel's product; the GGUF rows come back from its panels."""
    compiled_kernel("linear_q8")
    p = packed(40, 576, "q4_1")
    layer = PackedLinearQ8(PackedLinear(p))
    assert torch.equal(layer.gguf_rows(), p.data)
    assert torch.equal(layer.gguf_rows(torch.tensor([39, 0, 17, 17])), p.data[[39, 0, 17, 17]])
    with pytest.raises(RuntimeError, match="row 40 is not in 0..39"):
        layer.gguf_rows(torch.tensor([40]))
    assert torch.equal(layer._dense_weight(torch.float32), dequantize_torch(p.data, p.fmt, 576))
    x = torch.randn(2, 30, 576)
    ref = linear_q8_reference(x.reshape(60, 576), p).reshape(2, 30, 40)
    assert torch.allclose(layer(x).double(), ref, rtol=1e-5, atol=1e-4)
    assert torch.allclose(layer(x[0, :3]).double(), ref[0, :3], rtol=1e-5, atol=1e-4)
    y = layer(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 30, 40)
    assert torch.allclose(y.double(), linear_q8_reference(x.bfloat16().float().reshape(60, 576), p).reshape(2, 30, 40),
                          rtol=1e-2, atol=1e-2)
    q8_0 = packed(24, 64, "q8_0")
    q8_0.data[0, 2] = 128  # q = -128: GGUF allows it, though llama.cpp's quantizer makes -127..127
    x = torch.randn(9, 64)
    assert torch.allclose(PackedLinearQ8(PackedLinear(q8_0))(x).double(), linear_q8_reference(x, q8_0),
                          rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 3, 4, 7, 64])
def test_q8_0_extreme_codes_give_the_exact_integer_sums(isa, m):
    """Q8_0 codes -128 and 127 among others, scales 1, and activations whose blocks already are
    integers up to 127 (so the 8-bit rounding keeps them): every level gives sum(q x) exactly,
    whichever way it takes the signed codes (AVX-512 VNNI: q + 128, less 128 times the block's
    sum of x)."""
    kernel = compiled_kernel("linear_q8", isa)
    n, k = 40, 576
    g = torch.Generator().manual_seed(m)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    q[0], q[1], q[2, ::2] = -128, 127, -128
    x = torch.randint(-127, 128, (m, k), generator=g).float()
    x[:, ::32] = 127.0  # each block's largest magnitude 127: a step of 1
    x[0, 1::32] = -127.0
    d = torch.ones(1, dtype=torch.float16).view(torch.uint8).repeat(n, k // 32, 1)  # [n, nb, 2]
    data = torch.cat([d, q.view(torch.uint8).reshape(n, k // 32, 32)], -1).reshape(n, -1).contiguous()
    fmt = FORMATS["q8_0"]
    panels = kernel.pack_panels(data, fmt.ggml_type, k)
    y = kernel.linear_q8(x, panels, fmt.ggml_type, k, n, None)
    assert torch.equal(y.double(), x.double() @ q.double().T)
