"""KVCache: one preallocated K and one V tensor per layer, shaped
[num_blocks, block_size, kv_heads, head_dim].

Block-major layout keeps each block's tokens contiguous, so gathering a sequence's context is
one index over its block table (a copy of whole blocks, not of single slots), and a copy-on-write
or a swap moves one contiguous chunk per layer. Each layer has its own tensors: nothing is shared
between layers, and a sequence only ever reaches the blocks of its own table.
"""

from __future__ import annotations

from typing import Sequence

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: masked-out slots are still multiplied by 0 and must not be NaN
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[idx], self.v[idx]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def block_nbytes(self) -> int:
        return self.nbytes // self.num_blocks

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: dst block := src block, in every layer."""
        if not pairs:
            return
        src, dst = _index(pairs, self.k[0].device)
        for cache in self.k + self.v:
            cache[dst] = cache[src]

    def copy_to(self, other: "KVCache", pairs: Sequence[tuple[int, int]]) -> None:
        """Swap: other's block dst := this cache's block src (between CPU and device)."""
        if not pairs:
            return
        src, dst = _index(pairs, self.k[0].device)
        dst = dst.to(other.k[0].device)
        for mine, theirs in zip(self.k + self.v, other.k + other.v):
            theirs[dst] = mine[src].to(theirs.device, non_blocking=True)


def _index(pairs: Sequence[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
    return src, dst
