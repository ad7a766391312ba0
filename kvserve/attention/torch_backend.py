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

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, PrefillSpan, rotate_halves
from kvserve.core.block_math import cdiv
from kvserve.kv.storage import ChunkView, KVStorage


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    decode_mask: Optional[torch.Tensor] = None  # [B, 1, 1, L] additive: 0, or -inf where a query does not look
    decode_slots_per_block: int = 0  # min(block_size, longest context): narrows a contiguous slab
    decode_read_tables: Optional[torch.Tensor] = None  # [B, n] the table entries decodes read (None: all)
    # per chunk: None to attend causally within its own fresh K/V, else what it sees of the cache
    chunk_views: list[Optional[ChunkView]] = field(default_factory=list)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, block_size: int, dtype: torch.dtype) -> None:
        self.block_size, self.dtype = block_size, dtype

    def build_metadata(self, common: AttentionMetadata, storage: Optional[KVStorage]) -> TorchAttentionMetadata:
        meta = TorchAttentionMetadata(**vars(common))
        meta.chunk_views = [self._chunk_view(s, storage, common) for s in common.prefills]
        if common.num_decode_tokens:
            self._decode_mask(meta)
        return meta

    def _chunk_view(self, span: PrefillSpan, storage: Optional[KVStorage],
                    meta: AttentionMetadata) -> Optional[ChunkView]:
        """A chunk that starts its sequence attends to its fresh K/V where the cache gives them
        back as a cast (KVStorage.reads_back_as: the same numbers, without gathering them), or
        there is no cache: causally (None), or through a mask where a window is shorter than the
        chunk or sinks are scored apart (the view the cache would give, sink columns included).
        Otherwise it reads what the storage says, from the first block a window reaches (and the
        sinks' blocks)."""
        start, bs = span.context_len - span.q_len, self.block_size
        window, sinks = meta.sliding_window, meta.sinks
        device = span.block_table.device if span.block_table is not None else torch.device("cpu")
        q_pos = torch.arange(start, span.context_len, device=device).unsqueeze(1)
        fresh = (span.block_table is None or storage is None
                 or start == 0 and storage.reads_back_as() is not None)
        if fresh:
            if not sinks and (window is None or window >= span.q_len):
                return None
            k_pos = torch.arange(span.q_len, device=device)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= _in_window(k_pos, q_pos, window, sinks)
            return ChunkView(mask, from_cache=False, key_positions=k_pos,
                             sink_columns=k_pos < sinks if sinks else None)
        read_from = 0
        if window is not None:
            read_from = max(start - (window - sinks) + 1, 0) // bs
            if read_from < cdiv(sinks, bs):
                read_from = 0  # the sinks' blocks are read in place
        view = storage.chunk_view(start - read_from * bs, span.q_len, device)
        assert view.key_positions is not None
        k_pos = view.key_positions + read_from * bs
        view.read_from, view.key_positions = read_from, k_pos
        if window is not None:
            view.mask &= _in_window(k_pos, q_pos, window, sinks)
        # still plain causal where the window reaches back to position 0 from every query
        view.causal = (view.causal and not sinks and not read_from
                       and (window is None or window >= span.context_len))
        if sinks and read_from:  # the sinks come first, seen by every query of the chunk
            view.num_sinks = sinks
            view.mask = torch.cat([torch.ones(span.q_len, sinks, dtype=torch.bool, device=device), view.mask], 1)
            view.key_positions = torch.cat([torch.arange(sinks, device=device), k_pos])
        if sinks:
            view.sink_columns = view.key_positions < sinks
        return view

    def _decode_mask(self, meta: TorchAttentionMetadata) -> None:
        """Each decode reads its table (with a window, only the entries its window reaches and
        the sinks' blocks), gathered into [B, L] keys; the mask hides positions past its context
        and outside its window."""
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        tables, ctx, bs = meta.decode_block_tables, meta.decode_context_lens, self.block_size
        B, num_blocks = tables.shape
        device = tables.device
        if meta.sliding_window is None:
            meta.decode_slots_per_block = min(bs, meta.decode_max_context)
            k_pos = torch.arange(num_blocks * meta.decode_slots_per_block, device=device).expand(B, -1)
        else:
            meta.decode_slots_per_block = bs
            sink_blocks = cdiv(meta.sinks, bs)
            first = ((ctx - (meta.sliding_window - meta.sinks)).clamp(min=0) // bs).clamp(min=sink_blocks)
            n = max(int((cdiv_tensor(ctx, bs) - first).max()), 1)
            entries = first.unsqueeze(1) + torch.arange(n, device=device)  # [B, n]
            if sink_blocks:
                entries = torch.cat([torch.arange(sink_blocks, device=device).expand(B, -1), entries], 1)
            # entries past a table's end read its last block again, at positions the mask hides
            meta.decode_read_tables = tables.gather(1, entries.clamp(max=num_blocks - 1))
            k_pos = (entries.unsqueeze(2) * bs + torch.arange(bs, device=device)).reshape(B, -1)
        q_pos = (ctx - 1).unsqueeze(1)
        visible = k_pos <= q_pos
        if meta.sliding_window is not None:
            visible &= _in_window(k_pos, q_pos, meta.sliding_window, meta.sinks)
        mask = torch.zeros(B, 1, 1, k_pos.shape[1], dtype=self.dtype, device=device)
        meta.decode_mask = mask.masked_fill_(~visible.view(B, 1, 1, -1), float("-inf"))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                storage: Optional[KVStorage], meta: AttentionMetadata, scale: float,
                softcap: Optional[float] = None) -> torch.Tensor:
        assert isinstance(meta, TorchAttentionMetadata)
        self.write_kv(layer, k, v, storage, meta)
        nd = meta.num_decode_tokens
        if nd == q.shape[0] and meta.sink_rotation is None:  # decode only: no rows to place
            assert storage is not None
            return self.decode(layer, q, storage, meta, scale, softcap)
        out = q.new_empty(*q.shape[:2], v.shape[-1])  # values may be narrower than keys (MLA's latent)
        q_sink = None
        if meta.sink_rotation is not None:  # queries turned to their ranks, for the sinks' scores
            q_sink = rotate_halves(q, *meta.sink_rotation)
        if nd:
            assert storage is not None
            out[:nd] = self.decode(layer, q[:nd], storage, meta, scale, softcap,
                                   None if q_sink is None else q_sink[:nd])
        for span, view in zip(meta.prefills, meta.chunk_views):
            rows = slice(span.q_start, span.q_start + span.q_len)
            out[rows] = self._chunk(layer, q[rows], k[rows], v[rows], storage, span, view, scale, softcap,
                                    None if q_sink is None else q_sink[rows])
        return out

    def decode(self, layer: int, q: torch.Tensor, storage: KVStorage, meta: AttentionMetadata,
               scale: float, softcap: Optional[float] = None, q_sink: Optional[torch.Tensor] = None) -> torch.Tensor:
        assert isinstance(meta, TorchAttentionMetadata) and meta.decode_block_tables is not None
        B, H, D = q.shape
        tables = meta.decode_block_tables if meta.decode_read_tables is None else meta.decode_read_tables
        k, v = storage.gather(layer, tables, meta.decode_slots_per_block)
        kvh = k.shape[2]
        grouped = (B, kvh, H // kvh, D)  # query heads grouped under their K/V head
        sink_columns = None
        if meta.sinks:  # the sinks' blocks come first: their first `sinks` keys are the sinks
            sink_columns = torch.arange(k.shape[1], device=k.device) < meta.sinks
        o = attend(q.view(grouped), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), meta.decode_mask,
                   scale, softcap, None if q_sink is None else q_sink.view(grouped), sink_columns)
        return o.reshape(B, H, -1)

    def _chunk(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               storage: Optional[KVStorage], span: PrefillSpan, view: Optional[ChunkView],
               scale: float, softcap: Optional[float], q_sink: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A chunk's output, in the dtype it attended in (the caller's rows of the output take it
        in q's dtype: one conversion)."""
        keys, values = self._chunk_keys(layer, k, v, storage, span, view)
        return self._attend_chunk(q, keys, values, view, scale, softcap, q_sink)

    def _chunk_keys(self, layer: int, k: torch.Tensor, v: torch.Tensor, storage: Optional[KVStorage],
                    span: PrefillSpan, view: Optional[ChunkView]) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the chunk's view indexes: its own fresh K/V as the cache gives them
        back, or the cache's context (and the sinks before it)."""
        if view is None or not view.from_cache:  # the chunk's own fresh K/V, as the cache gives them back
            cast = storage.reads_back_as() if storage is not None and span.block_table is not None else None
            return (k, v) if cast is None else (k.to(cast), v.to(cast))
        assert storage is not None and span.block_table is not None
        offset = view.read_from * self.block_size
        keys, values = storage.chunk_context(layer, span.block_table[view.read_from:],
                                             span.context_len - span.q_len - offset, k, v)
        if view.num_sinks:
            sink_table = span.block_table[:cdiv(view.num_sinks, self.block_size)]
            sk, sv = storage.gather(layer, sink_table, self.block_size)
            keys = torch.cat([sk[:view.num_sinks].to(keys.dtype), keys])
            values = torch.cat([sv[:view.num_sinks].to(values.dtype), values])
        return keys, values

    def _attend_chunk(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      view: Optional[ChunkView], scale: float, softcap: Optional[float],
                      q_sink: Optional[torch.Tensor]) -> torch.Tensor:
        """The chunk's queries over its keys and values through the view's mask (none: causal)."""
        mask, sink_columns = (None, None) if view is None else (view.mask, view.sink_columns)
        written_out = softcap is not None or sink_columns is not None or q_sink is not None
        dtype = chunk_dtype(q, keys, written_out)
        return _attend_3d(q.to(dtype), keys.to(dtype), values.to(dtype), mask, scale, softcap, q_sink,
                          sink_columns)


def chunk_dtype(q: torch.Tensor, keys: torch.Tensor, written_out: bool) -> torch.dtype:
    """The dtype a chunk's attention over the cache runs in. On CPU, fp32 queries over a bf16
    cache attend in bf16: PyTorch's fused attention rounds the queries and the softmax weights
    to bf16, sums in fp32 and gives bf16 outputs (made fp32 again), in half to a third of fp32's
    time (one layer of SmolLM2, 128 tokens: 120 against 256 us; 512 tokens: 943 against 3,127).
    Elsewhere, and for a chunk whose scores are written out (`written_out`: soft caps, sinks),
    the queries' dtype; an fp32 cache (--exact) stays fp32."""
    on_cpu = q.device.type == "cpu"
    if on_cpu and q.dtype == torch.float32 and keys.dtype == torch.bfloat16 and not written_out:
        return torch.bfloat16
    return q.dtype


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
           softcap: Optional[float], q_sink: Optional[torch.Tensor] = None,
           sink_columns: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, H, Lq, D] over k, v [B, Hk, Lk, D] (H a multiple of Hk: grouped query heads); mask
    additive or bool (True: attend), None: causal. The key columns in sink_columns [Lk] are scored
    with q_sink instead of q. PyTorch's fused SDPA, or where scores are soft-capped or sinks
    scored (which SDPA cannot do) the same arithmetic written out."""
    if softcap is None and q_sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=q.shape[1] != k.shape[1], scale=scale)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if q_sink is not None and sink_columns is not None:
        sinks = sink_columns.nonzero().squeeze(1)
        scores[..., sinks] = torch.matmul(q_sink.float(), k[..., sinks, :].float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril_(k.shape[-2] - q.shape[-2])
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


def _attend_3d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
               softcap: Optional[float], q_sink: Optional[torch.Tensor] = None,
               sink_columns: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[L, heads, hd] tensors as one [1, heads, L, hd] batch: on CPU the 3-D form of SDPA falls
    back to the unfused math path (about 6x slower at 1,024 tokens), the 4-D form takes the fused
    flash kernel. No mask means causal within the chunk."""
    o = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale, softcap,
               None if q_sink is None else q_sink.transpose(0, 1)[None], sink_columns)
    return o[0].transpose(0, 1)


def _in_window(k_pos: torch.Tensor, q_pos: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """Whether a key is in a query's window: one of its last window - sinks positions, or a sink."""
    inside = k_pos > q_pos - (window - sinks)
    return inside | (k_pos < sinks) if sinks else inside


def cdiv_tensor(x: torch.Tensor, d: int) -> torch.Tensor:
    return (x + d - 1) // d
