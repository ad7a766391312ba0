"""KV storage: the object that owns a cache's tensors and every way they are read and moved.

    write(layer, k, v, slots)        the step's new K/V into their slots
    gather(layer, tables, n)         whole blocks of K/V as dense tensors, for the torch path
    layer_tensors(layer)             what a kernel reads in place
    copy_blocks(pairs)               copy-on-write inside the cache
    swap_out(dst, pairs)             blocks to another storage (the CPU pool), and back
    bytes_per_block, nbytes          the memory it holds, counted exactly

The attention backends talk to this interface, so a cache that stores K/V another way (in fewer
bits with scales, as a latent) is a new class, not a branch in attention.

DenseKVStorage keeps K and V as they are computed, block-major per layer:
[num_blocks, block_size, kv_heads, head_dim]. Each block's tokens are contiguous, so gathering a
sequence's context is one index over its block table (a copy of whole blocks, not of single
slots), and a copy-on-write or a swap moves one contiguous chunk per tensor. Tensor j holds the
j-th layer of every cache group (see kvserve.core.cache_group): a block id names one row of
each tensor, used by the group that holds the block. The last block is the null block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np
import torch

BlockPairs = Sequence[tuple[int, int]]


class KVStorage(ABC):
    num_blocks: int  # physical blocks, the null block included
    block_size: int

    @property
    @abstractmethod
    def bytes_per_block(self) -> int:
        """Bytes one block id holds, over every tensor (all layers of the group using it)."""

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] into slots [T] of the layer."""

    @abstractmethod
    def gather(self, layer: int, block_tables: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., nb] block ids -> K, V [..., nb * num_slots, kv_heads, head_dim] (the first
        num_slots slots of each block), in the dtype attention computes in."""

    @abstractmethod
    def layer_tensors(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The layer's tensors as stored, for kernels that read blocks in place."""

    @abstractmethod
    def copy_blocks(self, pairs: BlockPairs) -> None:
        """dst block := src block, in every tensor (copy-on-write)."""

    @abstractmethod
    def swap_out(self, dst: "KVStorage", pairs: BlockPairs) -> None:
        """dst's block b := this storage's block a, for each (a, b) (to the CPU pool)."""

    def swap_in(self, src: "KVStorage", pairs: BlockPairs) -> None:
        """This storage's block b := src's block a, for each (a, b) (back from the CPU pool)."""
        src.swap_out(self, pairs)


class DenseKVStorage(KVStorage):
    def __init__(self, layer_to_tensor: Sequence[int], num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.layer_to_tensor = list(layer_to_tensor)
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        num_tensors = max(self.layer_to_tensor) + 1
        self.k = [zeros(shape, dtype, device) for _ in range(num_tensors)]
        self.v = [zeros(shape, dtype, device) for _ in range(num_tensors)]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        j = self.layer_to_tensor[layer]
        self.k[j].view(-1, *k.shape[1:]).index_put_((slot_mapping,), k.to(self.dtype))
        self.v[j].view(-1, *v.shape[1:]).index_put_((slot_mapping,), v.to(self.dtype))

    def gather(self, layer: int, block_tables: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = self.layer_to_tensor[layer]
        return _gather(self.k[j], block_tables, num_slots), _gather(self.v[j], block_tables, num_slots)

    def layer_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = self.layer_to_tensor[layer]
        return self.k[j], self.v[j]

    def copy_blocks(self, pairs: BlockPairs) -> None:
        if not pairs:
            return
        src, dst = _index(pairs, self.k[0].device)
        for t in self.k + self.v:
            t[dst] = t[src]

    def swap_out(self, dst: KVStorage, pairs: BlockPairs) -> None:
        if not pairs:
            return
        assert isinstance(dst, DenseKVStorage) and dst.dtype == self.dtype, "swap between like storages"
        src_idx, dst_idx = _index(pairs, self.k[0].device)
        dst_idx = dst_idx.to(dst.k[0].device)
        for mine, theirs in zip(self.k + self.v, dst.k + dst.v):
            theirs[dst_idx] = mine[src_idx].to(theirs.device, non_blocking=True)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor. On CPU from calloc (through numpy), whose pages the OS hands out already
    zero when first touched: a 4 GiB cache is ready at once instead of after 5 s of writing
    zeros, and blocks never written (the null block among them) cost no memory. Zeros, not
    garbage: a padded or masked-out slot is still multiplied by 0 and must not be NaN."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, num_slots: int) -> torch.Tensor:
    """index_select over whole blocks copies contiguous chunks (about twice as fast as advanced
    indexing on CPU); narrowing first keeps a contiguous-layout slab from being copied whole."""
    src = cache if num_slots == cache.shape[1] else cache[:, :num_slots]
    blocks = src.index_select(0, block_tables.reshape(-1))  # [B * nb, s, kvh, hd]
    return blocks.view(*block_tables.shape[:-1], -1, *cache.shape[2:])


def _index(pairs: BlockPairs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
    return src, dst
