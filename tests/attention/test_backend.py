"""The compiled decode kernel equals the torch reference on random paged caches, on every code
path this CPU runs (the portable one everywhere)."""

import pytest
import torch

from kvserve.attention.backend import AttentionMetadata
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
    out = kernel(q, k, v, t, n, 64 ** -0.5)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("H, KVH, D", [(4, 2, 32), (2, 1, 128), (4, 4, 24), (16, 1, 64), (2, 2, 16)],
                         ids=["d32", "d128", "d24-scalar", "group16-scalar", "d16"])
def test_kernel_matches_reference_other_shapes(kernel, H, KVH, D):
    """Head dims and group sizes on the vectorized path and off it (the portable loop)."""
    lens = [1, 15, 16, 40, 257]
    q, k, v, t, n = build(len(lens), H, KVH, D, 16, lens, torch.float32, seed=D)
    ref = reference(q, k, v, t, n)
    assert (kernel(q, k, v, t, n, D ** -0.5) - ref).abs().max().item() < 1e-5


def test_kernel_softmax_holds_at_extreme_scores(kernel):
    """Scores far apart (one token dominates, others underflow to 0) stay finite and exact."""
    lens = [33, 5]
    q, k, v, t, n = build(2, 9, 3, 64, 16, lens, torch.float32, seed=7)
    q = q * 40
    ref = reference(q, k, v, t, n)
    out = kernel(q, k, v, t, n, 64 ** -0.5)
    assert torch.isfinite(out).all() and (out - ref).abs().max().item() < 1e-4


def test_kernel_matches_reference_bf16(kernel):
    lens = [7, 100, 300]
    q, k, v, t, n = build(3, 9, 3, 64, 16, lens, torch.bfloat16)
    ref = reference(q.float(), k.float(), v.float(), t, n)
    out = kernel(q, k, v, t, n, 64 ** -0.5).float()
    assert (out - ref).abs().max().item() < 2e-2


def test_torch_backend_can_be_forced(stories):
    compiled_kernel("paged_attention")
    assert make_engine(stories, attention_backend="torch").runner.backend.name == "torch"
    assert make_engine(stories, attention_backend="cpu-kernel").runner.backend.name == "cpu-kernel"
    assert make_engine(stories).runner.backend.name == "cpu-kernel"  # auto, on CPU
