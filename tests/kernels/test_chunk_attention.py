"""The prompt-chunk attention kernel (csrc/chunk_attention.cpp) on every level this CPU runs, at 1
and 2 threads: equal to float64 causal attention for chunks that start their sequence or follow
cached keys, every head layout and head dim it takes, fp32 and bf16 keys and strided rows; the
same numbers bit for bit for a query whichever chunk it is in; clear errors for what it does not
take. Then the CPU backend: which chunks it gives the kernel, and an engine's prompts prefilled
whole, in chunks and token by token through it."""

import pytest

import torch

from tests.conftest import (compiled_kernel, greedy, kernel_isas, make_engine, run_collecting_logits,
                            torch_threads)


@pytest.fixture(scope="module", params=kernel_isas("chunk_attention"))
def module(request):
    built = compiled_kernel("chunk_attention", request.param)
    assert built.isa() == request.param
    return built


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float64: query i of Lq at position Lk - Lq + i."""
    (lq, h, _), (lk, kvh, _) = q.shape, k.shape
    qq = q.double().transpose(0, 1)
    kk, vv = (t.double().repeat_interleave(h // kvh, 1).transpose(0, 1) for t in (k, v))
    scores = qq @ kk.transpose(-1, -2) * scale
    visible = torch.arange(lk)[None] <= (lk - lq + torch.arange(lq))[:, None]
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vv).transpose(0, 1)


def inputs(lq: int, lk: int, h: int, kvh: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(lq, h, d, generator=g) * 2  # scores of a few units: weights far from uniform
    k, v = (torch.randn(lk, kvh, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v


# (heads, K/V heads, head dim): every head dim the kernel takes, GQA groups of 1 to 6
HEADS = [(4, 2, 16), (4, 4, 32), (6, 1, 48), (9, 3, 64), (6, 2, 80), (8, 8, 96), (3, 1, 112), (8, 2, 128),
         (4, 2, 160), (2, 2, 192), (4, 1, 256)]


def test_every_head_dim_it_takes_is_tested(module):
    assert sorted(d for _, _, d in HEADS) == module.head_dims()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda s: "h{}-kv{}-d{}".format(*s))
@pytest.mark.parametrize("lq, lk", [(1, 1), (7, 7), (16, 16), (17, 17), (65, 65), (140, 140), (1, 90),
                                    (20, 83), (64, 200)])
def test_equals_float64_causal_attention(module, dtype, heads, lq, lk):
    q, k, v = inputs(lq, lk, *heads, dtype)
    scale = heads[2] ** -0.5
    ref = exact(q, k, v, scale)
    for threads in (1, 2):
        with torch_threads(threads):
            out = module.chunk_attention(q, k, v, scale)
        assert out.dtype == torch.float32 and out.shape == q.shape
        assert (out.double() - ref).abs().max().item() < 2e-5


def test_rows_any_stride_apart(module):
    """q, k and v as slices of wider rows (a fused q|k|v product's output): the same numbers."""
    g = torch.Generator().manual_seed(1)
    h, kvh, d, n = 9, 3, 64, 50
    fused = torch.randn(n, (h + 2 * kvh) * d, generator=g)
    q, k, v = fused.split([h * d, kvh * d, kvh * d], 1)
    q, k, v = q.view(n, h, d), k.view(n, kvh, d), v.view(n, kvh, d)
    assert not q.is_contiguous()
    out = module.chunk_attention(q, k, v, 0.125)
    assert torch.equal(out, module.chunk_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(8, 2, 64), (9, 3, 32), (6, 2, 80)],
                         ids=lambda s: "h{}-kv{}-d{}".format(*s))
def test_a_query_gets_the_same_numbers_in_any_chunk(module, dtype, heads):
    """A prompt of 150 tokens attended whole, or as chunks of 1, 16, 37 and 64 over the keys before
    them: every query's output is the same bit for bit (its keys summed in the same order)."""
    q, k, v = inputs(150, 150, *heads, dtype, seed=2)
    scale = heads[2] ** -0.5
    with torch_threads(2):
        whole = module.chunk_attention(q, k, v, scale)
    for size in (1, 16, 37, 64):
        for start in range(0, 150, size):
            end = min(start + size, 150)
            with torch_threads(1 + start % 2):
                part = module.chunk_attention(q[start:end], k[:end], v[:end], scale)
            assert torch.equal(part, whole[start:end])


def test_one_dominant_key_takes_all_the_weight(module):
    """Scores hundreds apart: each query's output is the value of its best key, no overflow."""
    lq, h, d = 40, 4, 32
    k = torch.zeros(lq, 1, d)
    k[:, 0, 0] = torch.arange(lq, dtype=torch.float32) * 100  # the latest key scores highest
    v = torch.randn(lq, 1, d)
    q = torch.zeros(lq, h, d)
    q[:, :, 0] = 1.0
    out = module.chunk_attention(q, k, v, 1.0)
    assert torch.equal(out, v.expand(lq, h, d))


def test_what_it_does_not_take_is_named(module):
    q, k, v = inputs(4, 4, 4, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="fp32 queries"):
        module.chunk_attention(q.bfloat16(), k, v, 0.1)
    with pytest.raises(RuntimeError, match="fp32 or bf16 keys and values"):
        module.chunk_attention(q, k.half(), v.half(), 0.1)
    with pytest.raises(RuntimeError, match="not more than its"):
        module.chunk_attention(torch.cat([q, q]), k, v, 0.1)
    with pytest.raises(RuntimeError, match="head dims"):
        module.chunk_attention(q[..., :8], k[..., :8], v[..., :8], 0.1)
    with pytest.raises(RuntimeError, match="multiple of KVH"):
        module.chunk_attention(q[:, :3], k, v, 0.1)
    assert module.chunk_attention(q[:0], k[:0], v[:0], 0.1).shape == (0, 4, 64)


def test_the_cpu_picks_the_kernel_or_sdpa():
    """The kernel everywhere it builds but on CPUs with AMX bf16 tiles, where SDPA keeps chunks."""
    from kvserve.attention.cpu_kernel import chunk_kernel
    built = compiled_kernel("chunk_attention")
    assert chunk_kernel(frozenset({"avx512f", "amx_bf16", "amx_tile"})) is None
    assert chunk_kernel(frozenset({"avx512f", "avx512_bf16"})) is built


@pytest.fixture
def backend(monkeypatch):
    """The CPU kernel backend with the chunk kernel, its calls counted."""
    from kvserve.attention.cpu_kernel import CpuKernelAttentionBackend
    built, calls = compiled_kernel("chunk_attention"), []

    class Counting:
        def head_dims(self):
            return built.head_dims()

        def chunk_attention(self, *args):
            calls.append(args[0].shape)
            return built.chunk_attention(*args)
    b = CpuKernelAttentionBackend(16, torch.float32, compiled_kernel("paged_attention"), Counting())
    return b, calls


def test_the_backend_gives_the_kernel_plain_causal_chunks_only(backend):
    from kvserve.kv.storage import ChunkView
    b, calls = backend
    q, k, v = inputs(20, 20, 4, 2, 64, torch.float32)
    causal = ChunkView(torch.ones(20, 20, dtype=torch.bool).tril(), causal=True)
    for view in (None, causal):
        out = b._attend_chunk(q, k, v, view, 0.125, None, None)
        assert (out.double() - exact(q, k, v, 0.125)).abs().max().item() < 2e-5
    assert len(calls) == 2
    windowed = ChunkView(torch.ones(20, 20, dtype=torch.bool).tril().triu(-3))  # not causal: SDPA
    b._attend_chunk(q, k, v, windowed, 0.125, None, None)
    b._attend_chunk(q, k, v, None, 0.125, 30.0, None)  # soft-capped scores are written out
    b._attend_chunk(q[..., :8], k[..., :8], v[..., :8], None, 0.125, None, None)  # a head dim it lacks
    b._attend_chunk(q, k, v[..., :32], None, 0.125, None, None)  # values narrower than keys (MLA)
    with pytest.raises(RuntimeError):  # fewer keys than the mask's columns: SDPA refuses, no kernel guess
        b._attend_chunk(q, k[:12], v[:12], causal, 0.125, None, None)
    assert len(calls) == 2
    half = b._attend_chunk(q, k.half(), v.half(), None, 0.125, None, None)  # fp16 keys: made fp32
    assert len(calls) == 3 and (half.double() - exact(q, k.half(), v.half(), 0.125)).abs().max() < 2e-5


@pytest.mark.parametrize("kind, window, sinks, causal", [
    ("dense", None, 0, True), ("dense", 40, 0, True), ("dense", 39, 0, False), ("dense", 10, 0, False),
    ("dense", None, 2, False), ("dense", 40, 2, False), ("int8", None, 0, True), ("int4", None, 0, False)])
def test_a_view_is_plain_causal_only_where_its_mask_is(kind, window, sinks, causal):
    """The torch backend's view of a chunk that follows cached keys (positions 24..39 over 0..39)
    says it is plain causal where its mask is: no sinks, a window (if any) that reaches position 0
    from every query, and the storage's own view causal (int4's tail of exact keys is not)."""
    from kvserve.attention.backend import AttentionMetadata, PrefillSpan
    from kvserve.attention.torch_backend import TorchAttentionBackend
    from kvserve.kv.storage import make_storage
    name = {"dense": "bfloat16", "int8": "int8", "int4": "int4"}[kind]
    storage = make_storage(kind, name, [0], 8, 16, 2, 64, torch.float32, "cpu", num_residual_slots=1)
    backend = TorchAttentionBackend(16, torch.float32)
    span = PrefillSpan(q_start=0, q_len=16, context_len=40, block_table=torch.tensor([3, 1, 5]))
    view = backend._chunk_view(span, storage, AttentionMetadata(sliding_window=window, sinks=sinks))
    assert view is not None and view.from_cache and view.causal == causal
    if causal:  # then the mask is every key up to the query's own position
        plain = torch.arange(40)[None] <= torch.arange(24, 40)[:, None]
        assert torch.equal(view.mask, plain)


@pytest.mark.parametrize("cache", ["bfloat16", "float32"])
def test_an_engine_prompt_attends_through_the_kernel_whole_chunked_or_token_by_token(tiny_llama, monkeypatch,
                                                                                       cache):
    """A random Llama (head dim 16) over a bf16 or fp32 cache: its prompts' chunks attend through
    the kernel. Prefilled whole, in chunks of 5 and a token at a time (later chunks reading the
    cache), the tokens are the same and the logits within 1e-4 (the products' sums differ with
    their rows), and each equal bit for bit to the same run whose chunks gather their own K/V back
    from the cache; within 1e-4 of SDPA's in fp32."""
    from kvserve.attention import cpu_kernel
    from kvserve.kv.storage import DenseKVStorage
    from tests.conftest import assert_same_outputs, fresh_and_gathered
    built = compiled_kernel("chunk_attention")
    calls = []

    class Counting:
        def head_dims(self):
            return built.head_dims()

        def chunk_attention(self, q, *args):
            calls.append(q.shape[0])
            return built.chunk_attention(q, *args)
    monkeypatch.setattr(cpu_kernel, "chunk_kernel", lambda flags: Counting())
    prompts = [[(7 * i + 3) % 120 + 1 for i in range(n)] for n in (9, 40, 70)]
    runs = {}
    for chunk in (None, 5, 1):
        def make():
            return make_engine(tiny_llama, kv_cache_dtype=cache, max_prefill_chunk=chunk,
                               max_num_batched_tokens=256 if chunk is None else 16)
        calls.clear()
        both = fresh_and_gathered(monkeypatch, DenseKVStorage, make, prompts, greedy(4))
        assert calls and (max(calls) > 5 if chunk is None else max(calls) <= chunk)
        assert_same_outputs(both[True], both[False])
        runs[chunk] = both[True]
    for chunk in (5, 1):
        for a, b in zip(runs[None][0], runs[chunk][0], strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            first, other = runs[None][1][a.request_id][0], runs[chunk][1][b.request_id][0]
            assert (first - other).abs().max().item() < 1e-4
    monkeypatch.setattr(cpu_kernel, "chunk_kernel", lambda flags: None)
    sdpa = run_collecting_logits(make_engine(tiny_llama, kv_cache_dtype=cache), prompts, greedy(4))
    for a, b in zip(runs[None][0], sdpa[0], strict=True):
        diff = (runs[None][1][a.request_id][0] - sdpa[1][b.request_id][0]).abs().max().item()
        assert diff < 1e-4 if cache == "float32" else diff < 5e-2  # SDPA over bf16 attends in bf16
