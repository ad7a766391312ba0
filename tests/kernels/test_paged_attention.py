"""The paged decode kernel where contexts are cut into parts: batch 1 over short and long contexts
(one part, a block and a token either side of one, many parts), sliding windows that start the
first part inside a block, every cache format and head dims 64/128/256, on every level this CPU
runs and 1 or 2 threads (the number of parts follows the thread count), against the torch
backend over the same blocks (gathered, dequantized, SDPA), or where scores are sharp against
float64 over them."""

import functools
from typing import Optional

import pytest

import torch

from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.cpu_kernel import decode_kernel
from kvserve.attention.torch_backend import TorchAttentionBackend
from kvserve.kv.storage import KVStorage, make_storage
from tests.conftest import compiled_kernel, kernel_isas, torch_threads

BLOCK = 16
FORMATS = ["float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2", "int4"]
SHAPES = {"d64": (9, 3, 64), "d128": (8, 2, 128), "d256": (4, 1, 256)}  # (H, KVH, D)


@pytest.fixture(scope="module", params=kernel_isas("paged_attention"))
def module(request):
    built = compiled_kernel("paged_attention", request.param)
    assert built.isa() == request.param
    return built


@functools.lru_cache(maxsize=64)
def filled(fmt: str, kvh: int, d: int, length: int) -> tuple[KVStorage, torch.Tensor]:
    """A one-layer storage of format `fmt` holding one context of `length` random tokens in
    shuffled blocks, written up to 100 tokens a step (an int4 context that does not fill its last
    block leaves it open, in its residual slot), and its block table [1, blocks]."""
    g = torch.Generator().manual_seed(length + d)
    kind = {"float32": "dense", "bfloat16": "dense", "float16": "dense"}.get(fmt, fmt.split("_")[0])
    nb = -(-length // BLOCK) + 1
    storage = make_storage(kind, fmt, [0], nb, BLOCK, kvh, d, torch.float32, "cpu", num_residual_slots=1)
    if kind == "fp8":
        storage.set_scales(torch.rand(1, 2, kvh, generator=g) * 0.02 + 0.01)
    table = torch.randperm(nb, generator=g)[:-1]  # one block left over: the null block below
    slots = (table.unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).reshape(-1)[:length]
    for start in range(0, length, 100):
        step = slots[start:start + 100]
        storage.begin_step()
        k, v = torch.randn(len(step), kvh, d, generator=g) * 2, torch.randn(len(step), kvh, d, generator=g)
        storage.write(0, k, v, storage.plan_writes(step))
    return storage, table.unsqueeze(0)


def null_block(storage: KVStorage, table: torch.Tensor) -> int:
    """The block no context holds (what a sliding-window group gives back is read as)."""
    return (set(range(storage.num_blocks)) - set(table.flatten().tolist())).pop()


def torch_decode(q: torch.Tensor, storage: KVStorage, table: torch.Tensor, lens: torch.Tensor,
                 window: int) -> torch.Tensor:
    backend = TorchAttentionBackend(BLOCK, torch.float32)
    meta = backend.build_metadata(AttentionMetadata(num_decode_tokens=len(lens), decode_block_tables=table,
                                                    decode_context_lens=lens, decode_max_context=int(lens.max()),
                                                    sliding_window=window or None), None)
    return backend.decode(0, q, storage, meta, q.shape[-1] ** -0.5)


def kernel_errors(module, q: torch.Tensor, storage: KVStorage, table: torch.Tensor, lens: torch.Tensor,
                  window: int = 0, ref: Optional[torch.Tensor] = None) -> list[float]:
    """The kernel's largest difference from `ref` (default: torch's) at 1 and at 2 threads."""
    ref = torch_decode(q, storage, table, lens, window) if ref is None else ref
    kernel, errors = decode_kernel(module, storage), []
    for threads in (1, 2):
        with torch_threads(threads):
            out = kernel(q, *storage.decode_operands(0), table, lens, q.shape[-1] ** -0.5, window)
        assert torch.isfinite(out).all()
        errors.append((out.to(ref.dtype) - ref).abs().max().item())
    return errors


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("length", [1, 15, 16, 17, 700, 3000])
def test_batch_of_one_split_into_parts_equals_torch(module, fmt, shape, length):
    H, KVH, D = SHAPES[shape]
    storage, table = filled(fmt, KVH, D, length)
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(1))
    assert max(kernel_errors(module, q, storage, table, torch.tensor([length]))) < 1e-5


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window", [1, 37, 100, 700, 2999])
def test_window_that_cuts_the_first_part_inside_a_block(module, fmt, window):
    """The context's first attended position falls inside a block (3000 - window is not a multiple
    of 16 but for window 1): the first part starts there, and blocks wholly behind the window are
    the null block, never read."""
    H, KVH, D = SHAPES["d64"]
    storage, table = filled(fmt, KVH, D, 3000)
    behind = table.clone()
    behind[0, :(3000 - window) // BLOCK] = null_block(storage, table)
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(2))
    assert max(kernel_errors(module, q, storage, behind, torch.tensor([3000]), window)) < 1e-5


@pytest.mark.parametrize("fmt", ["float32", "int8", "int4"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_dominant_token_leaves_the_other_parts_weightless(module, fmt, shape):
    """Sharp scores: one part holds nearly all the weight and the others' underflow to 0 when
    the parts are merged."""
    H, KVH, D = SHAPES[shape]
    storage, table = filled(fmt, KVH, D, 3000)
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(3)) * 40
    # Against the float64 computation, not torch's fp32 one: scores this sharp carry fp32's rounding
    # into the weights, and torch's own distance from float64 depends on the CPU's kernels (1.0e-4
    # on an AMD EPYC Zen 4, int4 d128); the builds' own stay under 4.1e-5 on every CPU.
    exact = exact_decode(q, storage, table, 3000)
    assert max(kernel_errors(module, q, storage, table, torch.tensor([3000]), ref=exact)) < 1e-4


def exact_decode(q: torch.Tensor, storage: KVStorage, table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's decode attention in float64 over the K/V rows the storage reads back."""
    k, v = (x[:, :length].double() for x in storage.gather(0, table, BLOCK))
    G, D = q.shape[1] // k.shape[2], q.shape[-1]
    s = torch.einsum("bhd,blhd->bhl", q.double(), k.repeat_interleave(G, dim=2)) * D ** -0.5
    return torch.einsum("bhl,blhd->bhd", s.softmax(-1), v.repeat_interleave(G, dim=2))


@pytest.mark.parametrize("fmt", ["float32", "int8", "fp8_e4m3", "int4"])
def test_head_dim_256_over_a_batch_with_windows(module, fmt):
    """Gemma 3's head dim (256, one K/V head for four query heads) over a batch of contexts of
    different lengths, some longer than the window and some shorter."""
    H, KVH, D = SHAPES["d256"]
    storage, table = filled(fmt, KVH, D, 3000)
    lens = torch.tensor([3000, 1000, 17, 1])  # one table read to different lengths
    q = torch.randn(4, H, D, generator=torch.Generator().manual_seed(4))
    assert max(kernel_errors(module, q, storage, table.expand(4, -1).contiguous(), lens, 512)) < 1e-5


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_a_batch_of_lengths_in_order_is_split_by_cost(module, fmt, order):
    """Contexts of 1 to 3000 tokens side by side in length order (a server's batch in the order its
    requests came), the skew the split by cost is for. On 2 and 3 threads every task runs once:
    the outputs are the same bit for bit as on 1 thread (one part a context at 24 of them: only
    which thread runs a task changes; a skipped task would leave its context without sums), and
    those are within 1e-5 of torch's. That the split balances the threads is timed, not tested:
    benchmarks/attention_batch_order.py."""
    H, KVH, D = SHAPES["d64"]
    storage, table = filled(fmt, KVH, D, 3000)
    lens = torch.tensor([1, 2, 3, 5, 8, 13, 16, 17, 21, 34, 55, 64, 89, 100, 144, 233, 377, 610, 987, 1597,
                         2000, 2584, 2999, 3000])
    lens = lens if order == "ascending" else lens.flip(0)
    tables = table.expand(len(lens), -1).contiguous()
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(5))
    ref = torch_decode(q, storage, tables, lens, 0)
    kernel, outs = decode_kernel(module, storage), []
    for threads in (1, 2, 3):
        with torch_threads(threads):
            outs.append(kernel(q, *storage.decode_operands(0), tables, lens, D ** -0.5, 0))
    assert (outs[0] - ref).abs().max().item() < 1e-5
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


HEADS = {"g1": (2, 2), "g2": (4, 2), "g5": (10, 2), "g8": (8, 1)}  # (H, KVH): query heads per K/V head 1, 2, 5, 8
BLOCK_SIZES = [1, 8, 32, 100]


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_heads_per_kv_head_head_dims_and_block_sizes(module, fmt, heads, d):
    """The value sums held in registers a few query heads at a time (1 to 8 a K/V head, so one
    pass or several), bf16 rows split into even and odd channels (head dims of 32 and more; 16
    is read whole), int8's scales applied to scores and weights, over blocks of 1 to 100 tokens,
    with and without a window that starts inside a block."""
    H, KVH = HEADS[heads]
    bs = BLOCK_SIZES[(list(HEADS).index(heads) + d // 16) % len(BLOCK_SIZES)]
    g = torch.Generator().manual_seed(d + H)
    lens = torch.tensor([1, 37, 150])
    per = -(-int(lens.max()) // bs)
    kind = "dense" if fmt != "int8" else "int8"
    storage = make_storage(kind, fmt, [0], 3 * per + 1, bs, KVH, d, torch.float32, "cpu")
    tables = torch.randperm(3 * per, generator=g).view(3, per)
    for b, n in enumerate(lens.tolist()):
        storage.begin_step()
        slots = (tables[b].unsqueeze(-1) * bs + torch.arange(bs)).reshape(-1)[:n]
        storage.write(0, torch.randn(n, KVH, d, generator=g) * 2, torch.randn(n, KVH, d, generator=g),
                      storage.plan_writes(slots))
    q = torch.randn(3, H, d, generator=g)
    kernel = decode_kernel(module, storage)
    for window in (0, 23):
        backend = TorchAttentionBackend(bs, torch.float32)
        meta = backend.build_metadata(AttentionMetadata(
            num_decode_tokens=3, decode_block_tables=tables, decode_context_lens=lens,
            decode_max_context=int(lens.max()), sliding_window=window or None), None)
        ref = backend.decode(0, q, storage, meta, d ** -0.5)
        for threads in (1, 2):
            with torch_threads(threads):
                out = kernel(q, *storage.decode_operands(0), tables, lens, d ** -0.5, window)
            assert (out - ref).abs().max().item() < 1e-5, (bs, window, threads)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_queries_of_any_layout_give_row_major_outputs(module, fmt):
    """q as a strided view (heads permuted in memory, or every other row of a wider tensor): the
    kernel reads a contiguous copy and writes its output row-major, equal to the contiguous q's."""
    H, KVH, D = SHAPES["d64"]
    storage, table = filled(fmt, KVH, D, 700)
    tables, lens = table.expand(3, -1).contiguous(), torch.tensor([700, 300, 17])
    g = torch.Generator().manual_seed(3)
    kernel = decode_kernel(module, storage)
    for q in (torch.randn(H, 3, D, generator=g).transpose(0, 1), torch.randn(6, H, D, generator=g)[::2]):
        assert not q.is_contiguous()
        out = kernel(q, *storage.decode_operands(0), tables, lens, D ** -0.5, 0)
        assert out.is_contiguous() and torch.equal(out, kernel(q.contiguous(), *storage.decode_operands(0), tables,
                                                               lens, D ** -0.5, 0))


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_tables_and_lengths_of_other_rows_than_q_are_refused(module, fmt):
    """A block table or a length for each of q's rows, no fewer and no other shape: read as given,
    a short one would have been read past its end."""
    H, KVH, D = SHAPES["d64"]
    storage, table = filled(fmt, KVH, D, 40)
    q, tables, lens = torch.randn(2, H, D), table.expand(2, -1).contiguous(), torch.tensor([40, 17])
    kernel = decode_kernel(module, storage)
    for t, n in ((tables[:1], lens), (tables, lens[:1]), (tables, lens[:, None]), (tables[0], lens)):
        with pytest.raises(RuntimeError, match="tables \\[B, max blocks\\] and lens \\[B\\] for q's B rows"):
            kernel(q, *storage.decode_operands(0), t, n, D ** -0.5, 0)
