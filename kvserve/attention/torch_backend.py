"""The torch reference backend: attention through PyTorch's SDPA over gathered blocks.

For every layer:
  1. the new K/V of all tokens are written to their slots,
  2. decodes attend together: their block tables are gathered into [B, L] contexts with a
     padding mask, and each query group attends to its one K/V head (GQA without repeating K/V),
  3. each chunk attends to its cached context (gathered) plus itself, causally.
With no cache (the recompute reference) every sequence is one chunk of its whole context.
It runs on any device and any storage; it is the reference the compiled kernels are held to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, PrefillSpan
from kvserve.kv.storage import ChunkView, KVStorage


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    decode_mask: Optional[torch.Tensor] = None  # [B, 1, 1, L] additive: 0, or -inf past each context
    decode_slots_per_block: int = 0  # min(block_size, longest context): narrows a contiguous slab
    # per chunk: None to attend causally within its own fresh K/V, else what it sees of the cache
    chunk_views: list[Optional[ChunkView]] = field(default_factory=list)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, block_size: int, dtype: torch.dtype) -> None:
        self.block_size, self.dtype = block_size, dtype

    def build_metadata(self, common: AttentionMetadata, storage: Optional[KVStorage]) -> TorchAttentionMetadata:
        meta = TorchAttentionMetadata(**vars(common))
        meta.chunk_views = [self._chunk_view(s, storage, common.sliding_window) for s in common.prefills]
        if common.num_decode_tokens:
            self._decode_mask(meta)
        return meta

    def _chunk_view(self, span: PrefillSpan, storage: Optional[KVStorage],
                    window: Optional[int]) -> Optional[ChunkView]:
        """A chunk that starts its sequence attends to its fresh K/V where the cache would give
        the same numbers back (or there is no cache): causally (None), or through a mask where a
        window is shorter than the chunk; otherwise it reads what the storage says."""
        start = span.context_len - span.q_len
        if span.block_table is None or storage is None or (start == 0 and storage.reads_back_exactly(self.dtype)):
            if window is None or window >= span.q_len:
                return None
            device = span.block_table.device if span.block_table is not None else torch.device("cpu")
            return ChunkView(window_causal_mask(0, span.q_len, span.q_len, window, device), from_cache=False)
        return storage.chunk_view(start, span.q_len, span.block_table.device, window)

    def _decode_mask(self, meta: TorchAttentionMetadata) -> None:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        B, num_blocks = meta.decode_block_tables.shape
        meta.decode_slots_per_block = min(self.block_size, meta.decode_max_context)
        length = num_blocks * meta.decode_slots_per_block
        device = meta.decode_block_tables.device
        positions = torch.arange(length, device=device).unsqueeze(0)
        outside = positions >= meta.decode_context_lens.unsqueeze(1)
        if meta.sliding_window is not None:  # and before the window (freed blocks read as the null block)
            outside |= positions < meta.decode_context_lens.unsqueeze(1) - meta.sliding_window
        mask = torch.zeros(B, 1, 1, length, dtype=self.dtype, device=device)
        meta.decode_mask = mask.masked_fill_(outside.view(B, 1, 1, length), float("-inf"))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                storage: Optional[KVStorage], meta: AttentionMetadata, scale: float,
                softcap: Optional[float] = None) -> torch.Tensor:
        assert isinstance(meta, TorchAttentionMetadata)
        self.write_kv(layer, k, v, storage, meta)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            assert storage is not None
            out[:nd] = self.decode(layer, q[:nd], storage, meta, scale, softcap)
        for span, view in zip(meta.prefills, meta.chunk_views):
            rows = slice(span.q_start, span.q_start + span.q_len)
            out[rows] = self._chunk(layer, q[rows], k[rows], v[rows], storage, span, view, scale, softcap)
        return out

    def decode(self, layer: int, q: torch.Tensor, storage: KVStorage, meta: AttentionMetadata,
               scale: float, softcap: Optional[float] = None) -> torch.Tensor:
        assert isinstance(meta, TorchAttentionMetadata) and meta.decode_block_tables is not None
        B, H, D = q.shape
        k, v = storage.gather(layer, meta.decode_block_tables, meta.decode_slots_per_block)
        kvh = k.shape[2]
        qg = q.view(B, kvh, H // kvh, D)  # query heads grouped under their K/V head
        o = attend(qg, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), meta.decode_mask, scale,
                   softcap)  # [B, kvh, group, D]
        return o.reshape(B, H, D)

    def _chunk(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               storage: Optional[KVStorage], span: PrefillSpan, view: Optional[ChunkView],
               scale: float, softcap: Optional[float]) -> torch.Tensor:
        if view is None or not view.from_cache:  # the chunk's own fresh K/V
            return _attend_3d(q, k, v, None if view is None else view.mask, scale, softcap)
        assert storage is not None and span.block_table is not None
        keys, values = storage.chunk_context(layer, span.block_table, span.context_len - span.q_len, k, v)
        return _attend_3d(q, keys.to(q.dtype), values.to(q.dtype), view.mask, scale, softcap)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
           softcap: Optional[float]) -> torch.Tensor:
    """q [B, H, Lq, D] over k, v [B, Hk, Lk, D] (H a multiple of Hk: grouped query heads); mask
    additive or bool (True: attend), None: causal. PyTorch's fused SDPA, or where scores are
    soft-capped (which SDPA cannot do) the same arithmetic written out."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=q.shape[1] != k.shape[1], scale=scale)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril_(k.shape[-2] - q.shape[-2])
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


def _attend_3d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
               softcap: Optional[float]) -> torch.Tensor:
    """[L, heads, hd] tensors as one [1, heads, L, hd] batch: on CPU the 3-D form of SDPA falls
    back to the unfused math path (about 6x slower at 1,024 tokens), the 4-D form takes the fused
    flash kernel. No mask means causal within the chunk."""
    o = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale, softcap)
    return o[0].transpose(0, 1)


def window_causal_mask(start: int, q_len: int, context_len: int, window: Optional[int],
                       device: torch.device) -> torch.Tensor:
    """[q_len, context_len] bool: query at position start + i sees key positions j <= start + i,
    and with a window only j > start + i - window."""
    q_pos = torch.arange(start, start + q_len, device=device).unsqueeze(1)
    k_pos = torch.arange(context_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
