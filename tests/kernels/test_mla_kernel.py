"""The absorbed-MLA decode kernel (csrc/mla_attention.cpp) reading latent rows in place: equal
to the torch backend (which gathers the rows and runs SDPA) within 1e-5 on random latent caches
in every format, at every level this CPU runs, for a batch of odd context lengths over several
blocks in a shuffled block table."""

import pytest
import torch

from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.cpu_kernel import decode_kernel, kernel_name
from kvserve.attention.torch_backend import TorchAttentionBackend
from kvserve.kv.latent import make_latent_storage
from tests.conftest import compiled_kernel, kernel_isas, torch_threads

BLOCK = 16
FORMATS = {"float32": "dense", "bfloat16": "dense", "int8": "int8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


@pytest.fixture(scope="module", params=kernel_isas("mla_attention"))
def mla_module(request):
    module = compiled_kernel("mla_attention", request.param)
    assert module.isa() == request.param
    return module


def filled_latents(fmt, lens, rank, rope, seed=0):
    """A latent storage whose sequences hold random rows at lens tokens each, in blocks taken out
    of order; their padded block tables and lengths."""
    nb = sum(-(-n // BLOCK) for n in lens) + 2
    storage = make_latent_storage(FORMATS[fmt], fmt, [0], nb, BLOCK, rank, rope, "cpu")
    g = torch.Generator().manual_seed(seed)
    free, tables = torch.randperm(nb - 1, generator=g).tolist(), []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // BLOCK))]
        tables.append(table)
        slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(n)])
        rows = torch.cat([torch.randn(n, 1, rank, generator=g), 3 * torch.randn(n, 1, rope, generator=g)], -1)
        storage.write(0, rows, rows[..., :rank], storage.plan_writes(slots))
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [nb - 1] * (width - len(t)) for t in tables])
    return storage, padded, torch.tensor(lens)


def torch_decode(storage, q, tables, lens, scale, window=None):
    backend = TorchAttentionBackend(BLOCK, q.dtype)
    meta = backend.build_metadata(AttentionMetadata(num_decode_tokens=len(lens), decode_block_tables=tables,
                                                    decode_context_lens=lens, decode_max_context=int(lens.max()),
                                                    sliding_window=window), None)
    return backend.decode(0, q, storage, meta, scale)  # gathers (dequantizes) the rows, SDPA


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("H, rank, rope", [(4, 32, 16), (3, 20, 6), (16, 64, 16)],
                         ids=["r32", "r20-odd", "h16-r64"])
def test_kernel_equals_gather_then_attend(mla_module, fmt, H, rank, rope):
    lens = [1, 7, 16, 17, 45, 130]
    storage, tables, n = filled_latents(fmt, lens, rank, rope)
    q = torch.randn(len(lens), H, rank + rope, generator=torch.Generator().manual_seed(1))
    scale = (rank // 2) ** -0.5
    ref = torch_decode(storage, q, tables, n, scale)
    out = decode_kernel(mla_module, storage)(q, *storage.decode_operands(0), tables, n, scale, 0)
    assert out.shape == (len(lens), H, rank)
    assert (out - ref).abs().max().item() < 1e-5


def test_a_long_context_split_into_parts_equals_torch(mla_module):
    """Batch 1 over 700 tokens: the context is cut into parts merged at the end."""
    storage, tables, n = filled_latents("float32", [700], 32, 8, seed=2)
    q = torch.randn(1, 8, 40, generator=torch.Generator().manual_seed(3))
    ref = torch_decode(storage, q, tables, n, 0.2)
    out = decode_kernel(mla_module, storage)(q, *storage.decode_operands(0), tables, n, 0.2, 0)
    assert (out - ref).abs().max().item() < 1e-5


def test_a_batch_of_lengths_in_order_is_split_by_cost(mla_module):
    """Contexts of 1 to 900 tokens in ascending order, split over the threads by the blocks each
    reads: every one attended (within 1e-5 of torch's), the same bit for bit on 1, 2 and 3
    threads (one part a context at 16 of them)."""
    lens = [1, 2, 3, 5, 8, 13, 16, 17, 30, 64, 100, 200, 333, 500, 700, 900]
    storage, tables, n = filled_latents("float32", lens, 32, 8, seed=5)
    q = torch.randn(len(lens), 8, 40, generator=torch.Generator().manual_seed(6))
    ref = torch_decode(storage, q, tables, n, 0.2)
    kernel, outs = decode_kernel(mla_module, storage), []
    for threads in (1, 2, 3):
        with torch_threads(threads):
            outs.append(kernel(q, *storage.decode_operands(0), tables, n, 0.2, 0))
    assert (outs[0] - ref).abs().max().item() < 1e-5
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_bf16_queries_over_a_bf16_cache(mla_module):
    storage, tables, n = filled_latents("bfloat16", [9, 40], 32, 16)
    q = torch.randn(2, 4, 48, generator=torch.Generator().manual_seed(4)).bfloat16()
    ref = torch_decode(storage, q.float(), tables, n, 0.25)
    out = decode_kernel(mla_module, storage)(q, *storage.decode_operands(0), tables, n, 0.25, 0)
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max().item() < 2e-2


def test_latent_blocks_are_read_by_the_mla_kernel_only(mla_module):
    storage, tables, n = filled_latents("float32", [5], 32, 16)
    assert kernel_name(storage) == "mla_attention"
    paged = compiled_kernel("paged_attention", "portable")
    with pytest.raises(ValueError, match="decoded by the mla_attention kernel"):
        decode_kernel(paged, storage)
    q = torch.randn(1, 4, 40)
    with pytest.raises(RuntimeError, match="q's width 40 is not the cache row's 48"):
        decode_kernel(mla_module, storage)(q, *storage.decode_operands(0), tables, n, 0.25, 0)
