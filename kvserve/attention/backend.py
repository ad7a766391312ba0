"""The attention backend interface and the metadata every backend starts from.

A step's tokens arrive flattened: first one token for each decoding sequence, then the
multi-token chunks (prompt chunks, and decodes that verify proposed tokens), each q_len long:

    rows      [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]
    positions [37 12 80 |  0  1  2  3 | 16 17]

For each cache group the runner describes the step once (`AttentionMetadata`: where each new
K/V goes, each decode's block table and context length, each chunk's span); a backend adds what
only it needs in `build_metadata` (the torch path its masks) and then, for every layer, writes
the new K/V through the storage and attends (`forward`). Metadata is data: no function travels
inside it, and a backend is chosen once per engine from the registry (kvserve.attention.select).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from kvserve.kv.storage import KVStorage


@dataclass
class PrefillSpan:
    """A chunk of q_len rows of one sequence, attending to its cached context and causally to
    itself. block_table is None where there is no cache (the recompute reference)."""

    q_start: int  # first row of the chunk in the flat batch
    q_len: int
    context_len: int  # cached tokens before the chunk + q_len
    block_table: Optional[torch.Tensor] = None  # [cdiv(context_len, block_size)]


@dataclass
class AttentionMetadata:
    """One cache group's view of a step, shared by every backend."""

    slot_mapping: Optional[torch.Tensor] = None  # [T]: where each new K/V goes; None: no cache
    kv_write_plan: Any = None  # the storage's plan for this step's writes (storage.plan_writes)
    num_decode_tokens: int = 0  # rows [0, num_decode_tokens) are single-token decodes
    decode_block_tables: Optional[torch.Tensor] = None  # [B, max_blocks], padded with the null block
    decode_context_lens: Optional[torch.Tensor] = None  # [B]
    decode_max_context: int = 0
    prefills: list[PrefillSpan] = field(default_factory=list)
    sliding_window: Optional[int] = None  # this group's layers attend to their last W positions only
    # attention sinks (StreamingLLM): the first `sinks` positions count within the window, so a
    # query attends to them and to its last W - sinks positions. Positions are ranks in the cache:
    # a recent key is as far from the query as in the sequence, a sink as far as its rank from the
    # query's rank min(p, W - 1); keys are stored rotated at their own positions, so a sink's score
    # takes the query turned back by p - rank (sink_rotation: cos, sin [T, head_dim/2] per row).
    sinks: int = 0
    sink_rotation: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # every row a decode writing to the cache, no chunk and no sinks (set by backends whose
    # fast_forward has a path for such steps)
    plain_decode: bool = False


@dataclass(frozen=True)
class LayerDecode:
    """A layer's plain decode (every row a decode: no chunk, no sinks) as compiled operations a
    decoder layer run as one call takes (layer_ops' DecodeLayer): `op`, a kvserve.DecodeOp capsule
    (kernels/csrc/kernel_ops.h) that attends over the layer's cache, and the layer_ops function
    `store` that writes the step's K/V into the `cache` tensors it takes before (slots, k, v)."""

    op: Any
    store: str
    cache: tuple[torch.Tensor, ...]


class AttentionBackend(ABC):
    """How attention reads and writes the cache. Contract: `forward` returns, for every row, the
    attention of its query over its sequence's context up to and including its own position,
    after writing the step's K/V (so a sequence admitted this step reads blocks another one fills
    this step); rows of one sequence never see another sequence's blocks."""

    name: str

    def build_metadata(self, common: AttentionMetadata, storage: Optional[KVStorage]) -> AttentionMetadata:
        """Once per step and group: the common description plus whatever this backend needs."""
        return common

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, storage: Optional[KVStorage],
                 meta: AttentionMetadata) -> None:
        if storage is not None and meta.slot_mapping is not None:
            storage.write(layer, k, v, meta.kv_write_plan)

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                storage: Optional[KVStorage], meta: AttentionMetadata, scale: float,
                softcap: Optional[float] = None) -> torch.Tensor:
        """q [T, heads, hd], k/v [T, kv_heads, hd] -> [T, heads, hd]. Scores are q.k * scale,
        capped to softcap * tanh(scores / softcap) where softcap is given, over each query's
        context (its last meta.sliding_window positions where the group has a window)."""


    def fast_forward(self, layer: int, group: int, scale: float, softcap: Optional[float],
                     storage: Optional[KVStorage]) -> Optional[Callable[..., torch.Tensor]]:
        """The attention layer's forward (q, k, v, ctx) -> out with what does not change between
        steps (this layer's kernel and operands) settled once; it must return what `forward`
        returns, bit for bit. None: the layer calls `forward` (the default)."""
        return None

    def layer_decode(self, layer: int, scale: float, softcap: Optional[float],
                     storage: Optional[KVStorage]) -> Optional[LayerDecode]:
        """What fast_forward does for a step of plain decodes (AttentionMetadata.plain_decode),
        the same kernels on the same arguments, as compiled operations; None (the default): none."""
        return None


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by angles cos, sin [T, head_dim/2]; the two halves rotate
    together (the Hugging Face layout of RoPE)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
