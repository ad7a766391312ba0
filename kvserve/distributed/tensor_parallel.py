"""Tensor parallelism (Megatron-style) on the loaded weights: what each rank holds, and the one
collective a decoder layer needs after each of its two row-parallel products.

Rank r of N holds, in every layer:

    q_proj      rows of heads      [r*H/N, (r+1)*H/N)         column-parallel: no communication
    k/v_proj    rows of KV heads    its share (below)           column-parallel
    o_proj      columns of its heads                             row-parallel: all-reduce after
    gate/up     rows [r*I/N, (r+1)*I/N)                          column-parallel
    down_proj   columns [r*I/N, (r+1)*I/N)                       row-parallel: all-reduce after

and everything else whole (embeddings, norms, the head). Its attention layers see a model of
H/N heads and its own KV heads, so the cache of each rank holds only those KV heads: every
block is split across the ranks, and one block table (rank 0's scheduler) indexes them all.

KV heads: with K >= N each rank holds K/N of them; with K < N (N a multiple of K) each holds the
one its query heads read, so each KV head is held by N/K ranks, as vLLM replicates them. Rank r's
query heads [r*H/N, (r+1)*H/N) read KV head h // (H/K), which is then r*K // N for all of them.

A GGUF's packed rows are split by rows as they are, and by columns in whole blocks of their
format (32 weights for Q8_0 / Q4_0 / Q5_0 / IQ4_NL ..., 256 for the K-quants): a split whose
columns do not fall on block boundaries is refused, naming the weight and its format.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from kvserve.config import ModelConfig
from kvserve.engine.parallel import CommStats
from kvserve.models.loaders.base import LoadedModel
from kvserve.models.packed import PackedWeight

Weight = torch.Tensor | PackedWeight


WHOLE_PROJECTION_QK_NORMS = ("olmo2",)  # RMS over all heads' q (or k) at once


def check_shardable(config: ModelConfig, world: int) -> None:
    """Raise ValueError naming what does not split over `world` ranks."""
    if world == 1:
        return
    h, k, i = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if config.moe is not None:
        raise ValueError(f"{config.name}'s experts (a mixture of experts) are not split across ranks yet; "
                         f"it is not served with tensor parallelism")
    if config.architecture in WHOLE_PROJECTION_QK_NORMS:
        raise ValueError(f"{config.name}'s q and k norms span every head ({config.architecture}): a rank holding "
                         f"its heads' share cannot compute them; not served with tensor parallelism yet")
    if h % world:
        raise ValueError(f"tensor parallel size {world} does not divide {config.name}'s {h} attention heads")
    if k % world and world % k:
        raise ValueError(f"tensor parallel size {world} and {config.name}'s {k} KV heads: one must divide "
                         "the other (KV heads are split, or replicated when there are fewer than ranks)")
    if i % world:
        raise ValueError(f"tensor parallel size {world} does not divide {config.name}'s MLP width {i}")


def num_kv_heads_per_rank(config: ModelConfig, world: int) -> int:
    return max(1, config.num_key_value_heads // world)


def kv_heads_of(config: ModelConfig, rank: int, world: int) -> range:
    """The KV heads rank holds (see the module's docstring)."""
    first = rank * config.num_key_value_heads // world
    return range(first, first + num_kv_heads_per_rank(config, world))


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The model one rank runs: its heads, KV heads and MLP width (head_dim stated, since
    hidden_size / heads no longer gives it)."""
    check_shardable(config, world)
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world,
                               num_key_value_heads=num_kv_heads_per_rank(config, world),
                               intermediate_size=config.intermediate_size // world, head_dim=config.head_dim)


def shard_weights(loaded: LoadedModel, rank: int, world: int) -> LoadedModel:
    """Rank's share of every weight (a new LoadedModel; the original is left whole)."""
    if world == 1:
        return loaded
    c = loaded.config
    hd, heads = c.head_dim, c.num_attention_heads // world
    q_rows = _span(rank * heads * hd, heads * hd)
    kv = kv_heads_of(c, rank, world)
    kv_rows = _span(kv.start * hd, len(kv) * hd)
    width = c.intermediate_size // world
    mlp_rows = _span(rank * width, width)
    sd: dict[str, Weight] = {}
    for name, w in loaded.state_dict.items():
        module, _, kind = name.rpartition(".")
        proj = module.rpartition(".")[2]
        if proj == "q_proj":
            w = _rows(w, q_rows)
        elif proj in ("k_proj", "v_proj"):
            w = _rows(w, kv_rows)
        elif proj in ("gate_proj", "up_proj"):
            w = _rows(w, mlp_rows)
        elif proj in ("o_proj", "down_proj") and kind == "weight":
            w = _columns(name, w, q_rows if proj == "o_proj" else mlp_rows)
        elif proj in ("o_proj", "down_proj") and kind == "bias" and rank != 0:
            w = torch.zeros_like(w)  # added once, after the sum over ranks
        sd[name] = w
    return dataclasses.replace(loaded, config=shard_config(c, world), state_dict=sd)  # type: ignore[arg-type]


def _span(start: int, length: int) -> slice:
    return slice(start, start + length)


def _rows(w: Weight, rows: slice) -> Weight:
    if isinstance(w, PackedWeight):
        return PackedWeight(w.fmt, w.data[rows].contiguous(), (rows.stop - rows.start, w.shape[1]))
    return w[rows].contiguous()


def _columns(name: str, w: Weight, cols: slice) -> Weight:
    if isinstance(w, PackedWeight):
        block = w.fmt.block
        if cols.start % block or cols.stop % block:
            raise ValueError(f"{name} is packed as {w.fmt.name} ({block} weights a block): a rank's columns "
                             f"[{cols.start}, {cols.stop}) do not fall on block boundaries, so it cannot be "
                             f"split over these ranks; choose a tensor parallel size that "
                             f"splits its {w.shape[1]} columns into multiples of {block}")
        n = w.shape[0]
        blocks = w.data.view(n, w.shape[1] // block, w.fmt.block_bytes)[:, cols.start // block:cols.stop // block]
        return PackedWeight(w.fmt, blocks.reshape(n, -1).contiguous(), (n, cols.stop - cols.start))
    return w[:, cols].contiguous()


class RowParallel(nn.Module):
    """A row-parallel product: this rank's columns of the weight times its part of the input
    give a partial sum; the all-reduce adds the ranks' partial sums into the full output."""

    def __init__(self, inner: nn.Module, stats: CommStats, group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.inner, self.stats, self.group = inner, stats, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        t0 = time.perf_counter()
        dist.all_reduce(y, group=self.group)
        self.stats.all_reduce_s += time.perf_counter() - t0
        self.stats.num_all_reduces += 1
        self.stats.all_reduce_bytes += y.numel() * y.element_size()
        return y


def install_row_parallel(model: nn.Module, stats: CommStats) -> None:
    """Wrap every o_proj and down_proj of the model's layers in RowParallel."""
    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, stats)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, stats)
