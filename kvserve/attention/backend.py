"""The torch reference attention over block tables.

A step's tokens arrive flattened: first one token for each decoding sequence, then the
prefill chunks, each [q_len] long. For every layer:
  1. the new K/V of all tokens are written to their slots (so a sequence admitted this step can
     read blocks another sequence fills this step),
  2. decodes attend together: their block tables are gathered into [B, L] contexts with a padding
     mask, and each query group attends to its one K/V head (GQA without repeating K/V),
  3. each prefill chunk attends to its cached context (gathered) plus itself, causally.
With no cache (the recompute reference) every sequence is a prefill of its whole context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

LayerCache = tuple[torch.Tensor, torch.Tensor]  # K, V: [num_blocks, block_size, kv_heads, head_dim]


@dataclass
class PrefillSpan:
    q_start: int  # first row of the chunk in the flat batch
    q_len: int
    context_len: int  # cached tokens before the chunk + q_len
    block_table: Optional[torch.Tensor] = None  # [num_blocks]; None: the chunk is the whole context
    mask: Optional[torch.Tensor] = None  # [q_len, context_len] bool, True = attend


@dataclass
class AttentionMetadata:
    slot_mapping: Optional[torch.Tensor] = None  # [T]: where each new K/V goes; None: no cache
    num_decode_tokens: int = 0  # rows [0, num_decode_tokens) are single-token decodes
    decode_block_tables: Optional[torch.Tensor] = None  # [B, max_blocks], padded with block 0
    decode_mask: Optional[torch.Tensor] = None  # [B, 1, 1, L] additive: 0, or -inf past each context
    decode_slots_per_block: int = 0  # min(block_size, longest context): the contiguous layout
    decode_context_lens: Optional[torch.Tensor] = None  # [B]
    # a compiled kernel reading blocks in place: (q, k_cache, v_cache, tables, lens, scale) -> out
    decode_kernel: Optional[Callable[..., torch.Tensor]] = None
    prefills: list[PrefillSpan] = field(default_factory=list)  # reads only what it holds


def write_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    k_cache, v_cache = cache
    k_cache.view(-1, *k.shape[1:]).index_put_((slot_mapping,), k)
    v_cache.view(-1, *v.shape[1:]).index_put_((slot_mapping,), v)


def gather_context(cache_tensor: torch.Tensor, block_tables: torch.Tensor, slots_per_block: int) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_blocks * slots_per_block, kv_heads, head_dim].

    index_select over whole blocks copies contiguous chunks (about twice as fast as advanced
    indexing on CPU); narrowing first keeps a contiguous-layout slab from being copied whole."""
    src = cache_tensor if slots_per_block == cache_tensor.shape[1] else cache_tensor[:, :slots_per_block]
    blocks = src.index_select(0, block_tables.reshape(-1))  # [B * nb, s, kvh, hd]
    return blocks.view(*block_tables.shape[:-1], -1, *cache_tensor.shape[2:])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Optional[LayerCache],
              meta: AttentionMetadata) -> torch.Tensor:
    """q [T, heads, hd], k/v [T, kv_heads, hd] -> [T, heads, hd]."""
    if cache is not None and meta.slot_mapping is not None:
        write_kv(cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        assert cache is not None
        out[:nd] = _decode(q[:nd], cache, meta)
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        out[rows] = _prefill(q[rows], k[rows], v[rows], cache, span)
    return out


def _decode(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata) -> torch.Tensor:
    B, H, D = q.shape
    assert meta.decode_block_tables is not None
    if meta.decode_kernel is not None:
        return meta.decode_kernel(q.contiguous(), cache[0], cache[1], meta.decode_block_tables,
                                  meta.decode_context_lens, D ** -0.5)
    k = gather_context(cache[0], meta.decode_block_tables, meta.decode_slots_per_block)
    v = gather_context(cache[1], meta.decode_block_tables, meta.decode_slots_per_block)
    kvh = k.shape[2]
    qg = q.view(B, kvh, H // kvh, D)  # query heads grouped under their K/V head
    o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=meta.decode_mask)  # [B, kvh, group, D]
    return o.reshape(B, H, D)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: Optional[LayerCache],
             span: PrefillSpan) -> torch.Tensor:
    if span.block_table is None:  # no earlier context: attend within the chunk
        o = _sdpa_4d(q, k, v, mask=None)
    else:
        assert cache is not None
        slots = min(cache[0].shape[1], span.context_len)
        kc = gather_context(cache[0], span.block_table, slots)[:span.context_len]
        vc = gather_context(cache[1], span.block_table, slots)[:span.context_len]
        o = _sdpa_4d(q, kc, vc, mask=span.mask)
    return o


def _sdpa_4d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """[L, heads, hd] tensors through SDPA as one [1, heads, L, hd] batch: on CPU the 3-D form
    falls back to the unfused math path (about 6x slower at 1,024 tokens), the 4-D form takes
    the fused flash kernel. No mask means causal within the chunk."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return o[0].transpose(0, 1)
