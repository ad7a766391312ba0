"""Cache groups: layers that share block tables.

A model's layers fall into groups by how they attend (every layer of a Llama attends to the
whole sequence: one group; a model with sliding-window layers between full ones has a group of
each). A request holds one block table per group, all drawn from the one BlockPool:

    positions        0..15   16..31  32..47  48..
    full group       [  7  |   3   |   9   |  12 ]      every block kept
    window group     [null | null  |   4   |  11 ]      blocks behind the window given back

Table entry i always covers positions [i * block_size, (i + 1) * block_size), so a slot is found
the same way in every group; a group that gives a block back leaves the null block in its place.
The layers' cache tensors are shared across groups (tensor j holds the j-th layer of every
group), so a block id names one row per tensor, used by whichever group holds the block.

`CacheGroup` states the contract; `FullAttentionGroup` keeps every block; `SlidingWindowGroup`
gives back the blocks its window has passed, so it holds at most the window plus one block per
sequence; `SinkWindowGroup` (StreamingLLM's attention sinks) also keeps the blocks of the first
tokens, so a stream of any length holds a constant number of blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from kvserve.core.block_math import block_offset, num_blocks_for, num_full_blocks
from kvserve.core.block_pool import BlockPool


@dataclass(frozen=True)
class CacheGroupSpec:
    """A kind of attention and the layers that have it."""

    kind: str  # "full" or "sliding"
    layers: tuple[int, ...]
    window: Optional[int] = None  # "sliding": a query attends to its last `window` positions
    sinks: int = 0  # "sliding": and to the first `sinks` positions, within the window's count

    @property
    def recent(self) -> Optional[int]:
        """How many most recent positions a query attends to (itself included)."""
        return None if self.window is None else self.window - self.sinks

    def max_blocks_held(self, num_tokens: int, block_size: int, step_tokens: int = 1) -> int:
        """The most pool blocks a sequence of num_tokens holds in such a group, computing up to
        step_tokens a step: all of its blocks, or a window's and the step's (the R recent
        positions of the step's first query through its last, R + step - 1 positions, span at
        most cdiv(R + step - 2, bs) + 1 blocks), and the sinks' blocks."""
        n = num_blocks_for(num_tokens, block_size)
        if self.recent is None:
            return n
        span = num_blocks_for(self.recent + step_tokens - 2, block_size) + 1
        return min(n, num_blocks_for(self.sinks, block_size) + span)

    def num_shared_blocks(self, num_prompt_tokens: int, block_size: int) -> int:
        """Blocks every sequence forked from one prompt holds in common however long they grow:
        the prompt's full blocks under full attention (a fork shares them); none in a window,
        which passes them by."""
        return num_full_blocks(num_prompt_tokens, block_size) if self.recent is None else 0


class CacheGroup:
    """The block tables of one group, over the shared pool.

    Contract: `tables[request_id][i]` is the block holding positions [i*bs, (i+1)*bs) of that
    request in this group's layers (or the null block where the group gave the block back);
    a table never holds more blocks than its request's tokens need. Every change at index i
    lowers `_synced[request_id]` to at most i, so the runner can be told only what changed.
    """

    def __init__(self, index: int, spec: CacheGroupSpec, pool: BlockPool, block_size: int) -> None:
        self.index, self.spec, self.pool, self.block_size = index, spec, pool, block_size
        self.tables: dict[str, list[int]] = {}
        self._synced: dict[str, int] = {}  # leading entries the runner already has

    # ---- queries ----
    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks to take so the table covers num_tokens positions."""
        return max(num_blocks_for(num_tokens, self.block_size) - len(self.table(request_id)), 0)

    def needs_copy_on_write(self, request_id: str, num_computed: int, num_new: int) -> bool:
        """Writing into a partially filled last block that another table shares."""
        table = self.table(request_id)
        return (num_new > 0 and bool(table) and block_offset(num_computed, self.block_size) != 0
                and table[-1] != self.pool.null_block_id and self.pool.blocks[table[-1]].ref_cnt > 1)

    def held_blocks(self, request_id: str) -> Iterator[int]:
        """The pool blocks the request holds in this group (null entries skipped)."""
        return (b for b in self.table(request_id) if b != self.pool.null_block_id)

    # ---- mutations ----
    def add_cached(self, request_id: str, blocks: list[int]) -> None:
        """A prefix hit on admission: the table starts with these (already cached) blocks."""
        self.pool.ref(blocks)
        self.tables.setdefault(request_id, []).extend(blocks)

    def copy_last_block(self, request_id: str) -> tuple[int, int]:
        """Copy-on-write: the shared last block is replaced by a private copy. Returns (src, dst)."""
        table = self.tables[request_id]
        shared = table[-1]
        (private,) = self.pool.take(1)
        self.pool.release([shared])
        table[-1] = private
        self._mark(request_id, len(table) - 1)
        return shared, private

    def grow(self, request_id: str, num_tokens: int) -> None:
        """Take new blocks so the table covers num_tokens positions."""
        n = self.num_new_blocks(request_id, num_tokens)
        self.tables.setdefault(request_id, []).extend(self.pool.take(n))

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past those num_tokens positions need, tail first (a rollback).
        A kept last block cut in the middle will be written again: if it was registered as a
        full block and is this table's alone, its hash is forgotten (the cache must not offer
        content that is about to change); if it is shared, the next write copies it."""
        table = self.tables.get(request_id)
        if table is None:
            return
        keep = num_blocks_for(num_tokens, self.block_size)
        if len(table) > keep:
            self.pool.release(reversed(table[keep:]))
            del table[keep:]
            self._mark(request_id, keep)
        if table and block_offset(num_tokens, self.block_size) and table[-1] != self.pool.null_block_id:
            if self.pool.blocks[table[-1]].ref_cnt == 1:
                self.pool.forget_hash(table[-1])

    def remove_skipped_blocks(self, request_id: str, num_computed: int) -> None:
        """Give back blocks attention will never read again; full attention reads them all."""

    def max_blocks_held(self, num_tokens: int, step_tokens: int = 1) -> int:
        """The most pool blocks one sequence of num_tokens holds in this group."""
        return self.spec.max_blocks_held(num_tokens, self.block_size, step_tokens)

    def needed_from(self, num_tokens: int) -> int:
        """The first table entry of the recent positions the next query (at position num_tokens)
        reads."""
        return 0

    @property
    def num_head_blocks(self) -> int:
        """Leading table entries every query reads, wherever it is (the sinks' blocks)."""
        return 0

    def needed(self, num_tokens: int, end: int) -> list[int]:
        """The table entries below `end` that the query at position num_tokens reads."""
        head = min(self.num_head_blocks, end)
        return list(range(head)) + list(range(max(head, self.needed_from(num_tokens)), end))

    def set_table(self, request_id: str, blocks: list[int]) -> None:
        """A table that comes back whole (swap in); the runner is sent all of it."""
        self.tables[request_id] = blocks
        self._synced[request_id] = 0

    def pop(self, request_id: str) -> list[int]:
        """Forget the request's table (freed or swapped out); returns it."""
        self._synced.pop(request_id, None)
        return self.tables.pop(request_id, [])

    def fork(self, parent_id: str, child_id: str) -> None:
        blocks = list(self.table(parent_id))
        self.pool.ref(blocks)
        self.tables[child_id] = blocks

    def take_update(self, request_id: str) -> Optional[tuple[int, list[int]]]:
        """What changed in the table since the last call: (first changed index, the entries
        from there on), or None when nothing did. Costs the changed entries only."""
        table = self.table(request_id)
        start = self._synced.get(request_id, 0)
        if start == len(table) and request_id in self._synced:
            return None
        self._synced[request_id] = len(table)
        return start, table[start:]

    def _mark(self, request_id: str, index: int) -> None:
        if request_id in self._synced:
            self._synced[request_id] = min(self._synced[request_id], index)


class FullAttentionGroup(CacheGroup):
    """Layers that attend to every earlier token: every block is kept."""


class SlidingWindowGroup(CacheGroup):
    """Layers that attend to their last W positions (their own included). A block whose positions
    all lie before the next query's window is read by no later query, so it goes back to the
    pool and the null block takes its place:

        W = 6, block size 4, next query at position 13: window 8..13
        table  [ 7 | 3 | 9 | 12 ]  ->  [ null | 3 | 9 | 12 ]      (positions 0..3 given back)
    """

    def __init__(self, index: int, spec: CacheGroupSpec, pool: BlockPool, block_size: int) -> None:
        super().__init__(index, spec, pool, block_size)
        assert spec.window is not None and spec.window >= 1
        self.window = spec.window
        self._skipped_to: dict[str, int] = {}  # per request: entries before this are given back already

    def set_table(self, request_id: str, blocks: list[int]) -> None:
        super().set_table(request_id, blocks)
        self._skipped_to.pop(request_id, None)

    def pop(self, request_id: str) -> list[int]:
        self._skipped_to.pop(request_id, None)
        return super().pop(request_id)

    def trim(self, request_id: str, num_tokens: int) -> None:
        super().trim(request_id, num_tokens)
        if request_id in self._skipped_to:
            self._skipped_to[request_id] = min(self._skipped_to[request_id], len(self.table(request_id)))

    def fork(self, parent_id: str, child_id: str) -> None:
        super().fork(parent_id, child_id)
        if parent_id in self._skipped_to:
            self._skipped_to[child_id] = self._skipped_to[parent_id]

    def needed_from(self, num_tokens: int) -> int:
        assert self.spec.recent is not None
        return max(num_tokens - self.spec.recent + 1, 0) // self.block_size

    def remove_skipped_blocks(self, request_id: str, num_computed: int) -> None:
        table = self.tables.get(request_id)
        if not table:
            return
        null = self.pool.null_block_id
        assert null is not None
        end = min(self.needed_from(num_computed), len(table))
        skip = range(max(self.num_head_blocks, self._skipped_to.get(request_id, 0)), end)
        self._skipped_to[request_id] = max(end, self._skipped_to.get(request_id, 0))
        skipped = [table[i] for i in skip if table[i] != null]
        if not skipped:
            return
        self.pool.release(reversed(skipped))
        for i in skip:
            if table[i] != null:
                table[i] = null
                self._mark(request_id, i)


class SinkWindowGroup(SlidingWindowGroup):
    """StreamingLLM: a query attends to the first S positions (the attention sinks) and its last
    W - S, so the blocks of the first S positions stay and those between them and the recent
    positions go back:

        S = 4, W = 12, block size 4, next query at position 21: sinks 0..3, recent 14..21
        table  [ 7 | 3 | 9 | 12 | 5 | 8 ]  ->  [ 7 | null | null | 12 | 5 | 8 ]
    """

    @property
    def num_head_blocks(self) -> int:
        return num_blocks_for(self.spec.sinks, self.block_size)


def groups_of(layer_kinds: Sequence[str], window: Optional[int], sinks: int = 0) -> tuple[CacheGroupSpec, ...]:
    """A model's layers grouped by how they attend, each kind cut into groups of g layers, g the
    largest size that divides every kind's count (groups must be equally large: tensor j holds the
    j-th layer of every group):

        groups_of(["sliding"] * 5 + ["full"] + ["sliding"] * 5 + ["full"], 4)
          == 6 groups of 2: sliding (0, 1), (2, 3), (4, 6), (7, 8), (9, 10); full (5, 11)
    """
    by_kind: dict[str, list[int]] = {}
    for i, kind in enumerate(layer_kinds):
        by_kind.setdefault(kind, []).append(i)
    size = math.gcd(*(len(v) for v in by_kind.values()))
    return tuple(CacheGroupSpec(kind, tuple(layers[j:j + size]), *((window, sinks) if kind == "sliding" else (None, 0)))
                 for kind, layers in by_kind.items() for j in range(0, len(layers), size))


def layer_maps(groups: tuple[CacheGroupSpec, ...], num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the group of each layer, the cache tensor of each layer): the j-th layer of every group
    shares tensor j, so all groups must have as many layers.

    layer_maps((CacheGroupSpec("full", (0, 2)), CacheGroupSpec("full", (1, 3))), 4)
        == ((0, 1, 0, 1), (0, 0, 1, 1))
    """
    sizes = {len(g.layers) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"cache groups must have equally many layers, got {sorted(sizes)}")
    layer_group, layer_tensor = [-1] * num_layers, [-1] * num_layers
    for gi, spec in enumerate(groups):
        for j, layer in enumerate(spec.layers):
            layer_group[layer], layer_tensor[layer] = gi, j
    if -1 in layer_group:
        raise ValueError(f"layers {[i for i, g in enumerate(layer_group) if g < 0]} are in no cache group")
    return tuple(layer_group), tuple(layer_tensor)


def make_group(index: int, spec: CacheGroupSpec, pool: BlockPool, block_size: int) -> CacheGroup:
    kinds: dict[str, type[CacheGroup]] = {"full": FullAttentionGroup, "sliding": SlidingWindowGroup}
    if spec.kind not in kinds:
        raise ValueError(f"unknown cache group kind {spec.kind!r}; known: {sorted(kinds)}")
    if spec.kind == "sliding" and spec.sinks:
        return SinkWindowGroup(index, spec, pool, block_size)
    return kinds[spec.kind](index, spec, pool, block_size)
