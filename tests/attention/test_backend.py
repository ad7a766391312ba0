"""The compiled decode kernel equals the torch reference on random paged caches, on every code
path this CPU runs (the portable one everywhere)."""

import pytest
import torch

from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.cpu_kernel import decode_kernel
from kvserve.attention.torch_backend import TorchAttentionBackend
from kvserve.kv.storage import DenseKVStorage
from tests.conftest import compiled_kernel, kernel_isas, make_engine


def build(B, H, KVH, D, BS, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-L // BS) for L in lens) + 3
    k_cache = torch.randn(nb, BS, KVH, D, generator=g).to(dtype)
    v_cache = torch.randn(nb, BS, KVH, D, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g).tolist()  # blocks scattered through the pool
    max_blocks = max(-(-L // BS) for L in lens)
    tables, i = [], 0
    for L in lens:
        n = -(-L // BS)
        tables.append(perm[i:i + n] + [0] * (max_blocks - n))
        i += n
    q = torch.randn(B, H, D, generator=g).to(dtype)
    return q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens)


def storage_of(k_cache, v_cache):
    """A one-layer dense storage holding these tensors."""
    nb, BS, KVH, D = k_cache.shape
    storage = DenseKVStorage([0], 1, BS, KVH, D, k_cache.dtype, "cpu")
    storage.tensors, storage.num_blocks = [{"k": k_cache, "v": v_cache}], nb
    return storage


def reference(q, k_cache, v_cache, tables, lens):
    """The torch backend's decode over the same blocks (gathered, padded, masked)."""
    B, H, D = q.shape
    backend = TorchAttentionBackend(k_cache.shape[1], q.dtype)
    meta = backend.build_metadata(AttentionMetadata(num_decode_tokens=B, decode_block_tables=tables,
                                                    decode_context_lens=lens,
                                                    decode_max_context=int(lens.max())), None)
    return backend.decode(0, q, storage_of(k_cache, v_cache), meta, D ** -0.5)


@pytest.fixture(scope="module", params=kernel_isas("paged_attention"))
def kernel(request):
    module = compiled_kernel("paged_attention", request.param)
    assert module.isa() == request.param
    return module.paged_decode


@pytest.mark.parametrize("H, KVH", [(8, 8), (9, 3), (4, 1)])
@pytest.mark.parametrize("BS", [1, 16, 32])
def test_kernel_matches_reference_fp32(kernel, H, KVH, BS):
    lens = [1, 17, 33, 64, 5]
    q, k, v, t, n = build(len(lens), H, KVH, 64, BS, lens, torch.float32)
    ref = reference(q, k, v, t, n)
    out = kernel(q, k, v, t, n, 64 ** -0.5, 0)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("H, KVH, D", [(4, 2, 32), (2, 1, 128), (4, 4, 24), (16, 1, 64), (2, 2, 16)],
                         ids=["d32", "d128", "d24-scalar", "group16-scalar", "d16"])
def test_kernel_matches_reference_other_shapes(kernel, H, KVH, D):
    """Head dims and group sizes on the vectorized path and off it (the portable loop)."""
    lens = [1, 15, 16, 40, 257]
    q, k, v, t, n = build(len(lens), H, KVH, D, 16, lens, torch.float32, seed=D)
    ref = reference(q, k, v, t, n)
    assert (kernel(q, k, v, t, n, D ** -0.5, 0) - ref).abs().max().item() < 1e-5


def test_kernel_softmax_holds_at_extreme_scores(kernel):
    """Scores far apart (one token dominates, others underflow to 0) stay finite and exact."""
    lens = [33, 5]
    q, k, v, t, n = build(2, 9, 3, 64, 16, lens, torch.float32, seed=7)
    q = q * 40
    ref = reference(q, k, v, t, n)
    out = kernel(q, k, v, t, n, 64 ** -0.5, 0)
    assert torch.isfinite(out).all() and (out - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[3000], [1500, 2, 700]])
@pytest.mark.parametrize("sharp", [False, True])
def test_kernel_splits_long_contexts_into_parts(kernel, threads, lens, sharp):
    """A long context is cut into parts along its blocks (few sequences, more tasks than threads)
    and the parts' softmaxes merged: the same result as one pass, also when one token dominates
    and the other parts' weights underflow."""
    q, k, v, t, n = build(len(lens), 9, 3, 64, 16, lens, torch.float32, seed=len(lens))
    if sharp:
        q = q * 40
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel(q, k, v, t, n, 64 ** -0.5, 0)
    finally:
        torch.set_num_threads(before)
    ref = reference(q, k, v, t, n)
    assert torch.isfinite(out).all() and (out - ref).abs().max().item() < (1e-4 if sharp else 1e-5)


def test_kernel_matches_reference_bf16(kernel):
    lens = [7, 100, 300]
    q, k, v, t, n = build(3, 9, 3, 64, 16, lens, torch.bfloat16)
    ref = reference(q.float(), k.float(), v.float(), t, n)
    out = kernel(q, k, v, t, n, 64 ** -0.5, 0).float()
    assert (out - ref).abs().max().item() < 2e-2


def test_torch_backend_can_be_forced(stories):
    compiled_kernel("paged_attention")
    assert make_engine(stories, attention_backend="torch").runner.backend.name == "torch"
    assert make_engine(stories, attention_backend="cpu-kernel").runner.backend.name == "cpu-kernel"
    assert make_engine(stories).runner.backend.name == "cpu-kernel"  # auto, on CPU


# ---- quantized caches: the kernel reads the blocks itself ----
from kvserve.kv.storage import make_storage  # noqa: E402

QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2", "int4"]


def filled_storage(fmt, lens, KVH=3, D=64, BS=16, seed=0):
    """A one-layer storage of format fmt holding len tokens per sequence, written a few tokens a
    step (so int4 has filled blocks and open ones), and each sequence's block table."""
    g = torch.Generator().manual_seed(seed)
    kind = "dense" if fmt in ("float32", "bfloat16") else fmt.split("_")[0]
    nb = sum(-(-L // BS) for L in lens) + 2
    storage = make_storage(kind, fmt, [0], nb, BS, KVH, D, torch.float32, "cpu", num_residual_slots=2)
    if kind == "fp8":
        storage.set_scales(torch.rand(1, 2, KVH, generator=g) * 0.02 + 0.01)
    perm = torch.randperm(nb - 1, generator=g).tolist()
    tables, i = [], 0
    for L in lens:
        n = -(-L // BS)
        tables.append(perm[i:i + n])
        i += n
    written = [0] * len(lens)
    while any(w < L for w, L in zip(written, lens)):
        slots = []
        for s, (w, L) in enumerate(zip(written, lens)):
            step = min(L - w, 1 + (w * 7 + s) % 23)
            slots += [tables[s][p // BS] * BS + p % BS for p in range(w, w + step)]
            written[s] = w + step
        slots = torch.tensor(slots)
        storage.begin_step()
        k, v = torch.randn(len(slots), KVH, D, generator=g) * 2, torch.randn(len(slots), KVH, D, generator=g)
        storage.write(0, k, v, storage.plan_writes(slots))
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [nb - 1] * (width - len(t)) for t in tables])
    return storage, padded, torch.tensor(lens)


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("H, D", [(9, 64), (6, 32), (6, 24)], ids=["d64-fast", "d32-fast", "d24-portable"])
def test_kernel_over_quantized_blocks_equals_dequantize_then_attend(kernel_module, fmt, H, D):
    lens = [1, 15, 16, 17, 40, 100]
    storage, tables, n = filled_storage(fmt, lens, KVH=3, D=D)
    if fmt == "int4":
        assert (storage.slot_of[tables.flatten()] >= 0).any()  # some blocks are still filling
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(1))
    backend = TorchAttentionBackend(16, torch.float32)
    meta = backend.build_metadata(AttentionMetadata(num_decode_tokens=len(lens), decode_block_tables=tables,
                                                    decode_context_lens=n, decode_max_context=int(n.max())), None)
    ref = backend.decode(0, q, storage, meta, D ** -0.5)  # gathers, dequantizes, SDPA
    out = decode_kernel(kernel_module, storage)(q, *storage.decode_operands(0), tables, n, D ** -0.5, 0)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.fixture(scope="module", params=kernel_isas("paged_attention"))
def kernel_module(request):
    module = compiled_kernel("paged_attention", request.param)
    assert module.isa() == request.param
    return module


def test_kernel_reads_a_bf16_cache_for_fp32_queries(kernel_module):
    lens = [5, 33, 70]
    storage, tables, n = filled_storage("bfloat16", lens)
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(2))
    backend = TorchAttentionBackend(16, torch.float32)
    meta = backend.build_metadata(AttentionMetadata(num_decode_tokens=3, decode_block_tables=tables,
                                                    decode_context_lens=n, decode_max_context=int(n.max())), None)
    ref = backend.decode(0, q, storage, meta, 0.125)
    out = decode_kernel(kernel_module, storage)(q, *storage.decode_operands(0), tables, n, 0.125, 0)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("fmt", ["float32", "int8", "int4"])
@pytest.mark.parametrize("window", [1, 5, 16, 37, 700])
def test_kernel_attends_to_the_last_window_positions_only(kernel_module, fmt, window):
    """Blocks wholly behind the window are the null block in a sliding-window group: the kernel
    never reads them, the torch path masks them (a window of 700 is cut into parts)."""
    lens = [3, 20, 64, 100, 1000]
    storage, tables, n = filled_storage(fmt, lens)
    null = storage.num_blocks - 1
    for b, L in enumerate(lens):  # give back what is wholly behind each window
        for i in range(max(0, L - window) // 16):
            tables[b, i] = null
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(3))
    backend = TorchAttentionBackend(16, torch.float32)
    meta = backend.build_metadata(AttentionMetadata(num_decode_tokens=len(lens), decode_block_tables=tables,
                                                    decode_context_lens=n, decode_max_context=int(n.max()),
                                                    sliding_window=window), None)
    ref = backend.decode(0, q, storage, meta, 0.125)
    out = decode_kernel(kernel_module, storage)(q, *storage.decode_operands(0), tables, n, 0.125, window)
    assert (out - ref).abs().max().item() < 1e-5


def test_chunk_dtype_is_bf16_only_over_a_bf16_cache_on_cpu():
    """fp32 queries over a bf16 cache on CPU attend in bf16; over fp32 or fp16 rows, with bf16
    queries, or where scores are written out (soft caps, sinks), in the queries' dtype."""
    from kvserve.attention.torch_backend import chunk_dtype
    q = torch.randn(4, 9, 64)
    rows = {dt: torch.randn(4, 3, 64).to(dt) for dt in (torch.bfloat16, torch.float32, torch.float16)}
    assert chunk_dtype(q, rows[torch.bfloat16], False) == torch.bfloat16
    assert chunk_dtype(q, rows[torch.bfloat16], True) == torch.float32
    assert chunk_dtype(q, rows[torch.float32], False) == torch.float32
    assert chunk_dtype(q, rows[torch.float16], False) == torch.float32
    assert chunk_dtype(q.bfloat16(), rows[torch.bfloat16], False) == torch.bfloat16


@pytest.mark.parametrize("cache, attends_in", [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_prompts_attend_over_a_bf16_cache_in_bf16(stories, monkeypatch, cache, attends_in):
    """The engine's prompt chunks (whole and cut into pieces) attend in bf16 over a bf16 cache
    and in fp32 over an fp32 cache; either way the tokens are the fp32 cache's. (The chunks'
    attention is recorded, not the decodes', which take the paged kernel or, with the kernels
    off, fp32 queries over the cache's rows.)"""
    from kvserve.attention import torch_backend
    from tests.conftest import greedy, run_collecting_logits
    seen = []
    chunk_attention = torch_backend._attend_3d

    def recording(q, *args, **kwargs):
        seen.append(q.dtype)
        return chunk_attention(q, *args, **kwargs)

    prompts = [stories.tokenizer.encode("Once upon a time there was a little girl named Lily who loved")]
    expected, _ = run_collecting_logits(make_engine(stories, kv_cache_dtype="float32"), prompts, greedy(8))
    monkeypatch.setattr(torch_backend, "_attend_3d", recording)
    for chunk in (None, 5):
        seen.clear()
        engine = make_engine(stories, kv_cache_dtype=cache, max_prefill_chunk=chunk,
                             max_num_batched_tokens=16)
        got, _ = run_collecting_logits(engine, prompts, greedy(8))
        assert seen and set(seen) == {attends_in}
        assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


@pytest.mark.parametrize("cache", ["bfloat16", "float16"])
@pytest.mark.parametrize("window, sinks", [(None, 0), (6, 0), (6, 2)], ids=["full", "window", "window-sinks"])
def test_a_prompt_over_a_cast_cache_attends_to_its_fresh_kv_as_the_cache_gives_them(stories, monkeypatch,
                                                                                   cache, window, sinks):
    """A chunk that starts its sequence over a bf16 or fp16 cache of fp32 K/V attends to its own
    K/V cast to the cache's dtype instead of gathering them back from the blocks it just wrote:
    every logit equals the gathered path's bit for bit, prompts of 6 to over 100 tokens whole or
    in chunks of 5 (the chunks after the first read the cache), with a window shorter than the
    prompts, and with attention sinks (scored apart, so attended in fp32 either way); the cache is
    read only where a chunk does not start its sequence."""
    from kvserve.kv.storage import DenseKVStorage
    from tests.conftest import assert_same_outputs, fresh_and_gathered, greedy
    long_text = " ".join(["Lily went to the park with her mom and saw a big red ball."] * 8)
    prompts = [stories.tokenizer.encode("Once upon a time there was a little girl named Lily who loved"),
               stories.tokenizer.encode("The dog ran to the park"), stories.tokenizer.encode(long_text)]
    assert len(prompts[2]) > 96  # past one query block of the fused attention
    for chunk in (None, 5):
        def make():
            return make_engine(stories, kv_cache_dtype=cache, sliding_window=window, attention_sinks=sinks,
                               max_prefill_chunk=chunk, max_num_batched_tokens=256 if chunk is None else 16)
        runs = fresh_and_gathered(monkeypatch, DenseKVStorage, make, prompts, greedy(6))
        assert_same_outputs(runs[True], runs[False])
        fresh_reads, old_reads = runs[True][2], runs[False][2]
        assert 0 not in fresh_reads and 0 in old_reads  # no chunk starting its sequence gathers
        if chunk is None:
            assert not fresh_reads  # whole prompts: nothing read back
        else:
            assert fresh_reads  # later chunks still read the cache
