"""BlockPool: every physical KV block, its reference count and its prefix-cache identity.

Each of the `num_blocks` blocks (ids 0 .. num_blocks - 1) is exactly one of:
  free              ref_cnt 0, no hash          -> in the free queue
  cached-evictable  ref_cnt 0, hash registered  -> in the Evictor, ranked for eviction
  referenced        ref_cnt > 0                 -> in one or more block tables, in neither

One more block, the null block (id `num_blocks`), belongs to nobody: block tables hold it where a
position's block was given back (a sliding window moved past it) and where a batch pads a short
table. It is never handed out, hashed or counted, and the cache keeps it all zeros, so reading it
through a padded table is harmless. A pool for swapped-out blocks has none.

Blocks are handed out from the free queue first (a block released without a hash goes to its
front, so the most recently used memory is reused first); only when it is empty is a cached
block evicted, the one the Evictor chooses: lowest retention priority first, then by the
eviction policy (`kvserve.core.eviction`: lru, fifo, priority, cost). Whoever must know that a
hash is gone (a tier below the pool keeping the block's K/V, KV events) listens on `on_evict`:
it is called with (block_id, block_hash) before the block is handed out, while its K/V is whole.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Callable, Iterable, Mapping, Optional

from kvserve.core.block_hash import BlockHash
from kvserve.core.eviction import Block, Evictor, make_policy
from kvserve.core.observers import Observers
from kvserve.core.retention import RetentionRange

__all__ = ["Block", "BlockPool"]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, null_block: bool = True,
                 eviction_policy: str = "lru", clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.null_block_id: Optional[int] = num_blocks if null_block else None
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._num_children: Counter[BlockHash] = Counter()  # cached blocks whose parent has this hash
        self.clock = clock
        self.evictor = Evictor(make_policy(eviction_policy), self.blocks, clock, self.is_leaf)
        self._stamp = 0  # event counter: the order blocks were cached and released in
        self.num_evictions = 0
        self.released: list[int] = []  # blocks that reached ref_cnt 0 since take_released()
        self.on_evict: Observers[[int, BlockHash]] = Observers()  # (block_id, block_hash) before reuse
        self.on_cache: Observers[[Block]] = Observers()  # a block registered under its hash (KV events)
        self.on_drop: Observers[[Block]] = Observers()  # a block's hash about to go, for any reason
        self.on_reset: Observers[[]] = Observers()  # every hash went (reset_prefix_cache)

    # ---- queries (never mutate) ----
    @property
    def eviction_policy(self) -> str:
        return self.evictor.policy.name

    @property
    def num_physical_blocks(self) -> int:
        """Blocks the cache tensors hold: the pool's blocks and the null block."""
        return self.num_blocks + (self.null_block_id is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus cached-evictable."""
        return len(self._free_queue) + len(self.evictor)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def can_take(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def is_evictable(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_cnt == 0

    def is_leaf(self, block: Block) -> bool:
        """Whether no cached block continues its prefix chain."""
        return block.block_hash is None or self._num_children[block.block_hash] == 0

    def lookup(self, block_hash: BlockHash, parent_hash: BlockHash,
               token_ids: tuple[int, ...]) -> Optional[int]:
        """The cached block with this hash, only if its parent and tokens match too."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None  # a hash collision: never return K/V computed for other tokens
        return block_id

    # ---- mutations ----
    def take(self, num_blocks: int) -> list[int]:
        """Hand out num_blocks blocks with ref_cnt 1: free ones first, then cached ones evicted
        in the Evictor's order."""
        if not self.can_take(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            if self._free_queue:
                block_id, _ = self._free_queue.popitem(last=False)
            else:
                block_id = self.evictor.pop_victim()
                self._evict(self.blocks[block_id])
            self.blocks[block_id].ref_cnt = 1
            taken.append(block_id)
        return taken

    def ref(self, block_ids: Iterable[int]) -> None:
        """One more block table points at each block (a prefix hit or a fork); the null block,
        which tables may hold anywhere, is nobody's and is skipped."""
        for block_id in block_ids:
            if block_id == self.null_block_id:
                continue
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self._unqueue(block_id)
            if block.block_hash is not None:
                block.num_hits += 1
            block.ref_cnt += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """One block table fewer points at each block; a block reaching zero becomes free or
        cached-evictable. The null block is skipped, as in `ref`.

        Callers pass a sequence's blocks tail first, so (under LRU) its last blocks are evicted
        before its first ones, which more requests are likely to share.
        """
        for block_id in block_ids:
            if block_id == self.null_block_id:
                continue
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block_id} released more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.released.append(block_id)
                self._queue(block)

    def cache(self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash,
              token_ids: tuple[int, ...]) -> None:
        """Register a full block under its hash; a hash already held by another block is kept."""
        block = self.blocks[block_id]
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached[block_hash] = block_id
        self._num_children[parent_hash] += 1
        parent = self._cached.get(parent_hash)
        block.depth = self.blocks[parent].depth + 1 if parent is not None else 0
        if parent is not None:
            self.evictor.rerank(parent)  # no longer a leaf, if it waits
        block.cached_at = self._next_stamp()
        self.on_cache(block)
        if block.ref_cnt == 0:  # cached while nobody holds it: it waits as cached-evictable
            del self._free_queue[block_id]
            self.evictor.add(block)

    def retain(self, block_id: int, retention: Optional[RetentionRange], user_priority: int) -> None:
        """A request uses this cached block: it carries the request's retention range (the higher
        priority wins, the longer duration among equals) and the most important user's priority."""
        block = self.blocks[block_id]
        if block.block_hash is None:
            return
        block.user_priority = user_priority if block.user_priority is None else min(block.user_priority, user_priority)
        if retention is None:
            return
        now = self.clock()
        current = block.asked_retention(now)  # the default counts for nothing: a request may ask for less
        expiry = None if retention.duration_s is None else now + retention.duration_s
        if (current is None or retention.priority > current
                or (retention.priority == current and _later(expiry, block.retention_expiry))):
            block.retention_priority, block.retention_expiry = retention.priority, expiry
            self.evictor.rerank(block_id)  # if it waits

    def take_released(self) -> list[int]:
        """The blocks nobody references any more since the last call (a storage that keeps state
        per block, such as int4's open blocks, forgets theirs)."""
        released, self.released = self.released, []
        return released

    def forget_hash(self, block_id: int) -> None:
        """Unregister a block that its only holder is about to overwrite (after a rollback)."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._drop_hash(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after new weights are loaded)."""
        for block in self.blocks:
            if block.block_hash is not None:
                self._drop_hash(block)
        self.on_reset()

    # ---- helpers ----
    def _next_stamp(self) -> int:
        self._stamp += 1
        return self._stamp

    def _queue(self, block: Block) -> None:
        """A block nobody references: cached-evictable if it has a hash, else free."""
        block.last_used = self._next_stamp()
        if block.block_hash is not None:
            self.evictor.add(block)
        else:
            self._free_queue[block.block_id] = None
            self._free_queue.move_to_end(block.block_id, last=False)

    def _unqueue(self, block_id: int) -> None:
        if block_id in self.evictor:
            self.evictor.remove(block_id)
        else:
            del self._free_queue[block_id]

    def _evict(self, block: Block) -> None:
        """The Evictor chose this block: its hash goes, and listeners hear of it first."""
        assert block.block_hash is not None
        if self.on_evict:
            self.on_evict(block.block_id, block.block_hash)
        self._drop_hash(block)
        self.num_evictions += 1

    def _drop_hash(self, block: Block) -> None:
        """Unregister the block's hash; a waiting block moves from the Evictor to the free queue."""
        assert block.block_hash is not None and block.parent_hash is not None
        self.on_drop(block)
        del self._cached[block.block_hash]
        self._num_children[block.parent_hash] -= 1
        if not self._num_children[block.parent_hash]:
            del self._num_children[block.parent_hash]
            parent = self._cached.get(block.parent_hash)
            if parent is not None:
                self.evictor.rerank(parent)  # now a leaf
        if block.block_id in self.evictor:
            self.evictor.remove(block.block_id)
            self._free_queue[block.block_id] = None
        block.block_hash = block.parent_hash = block.token_ids = None
        block.reset_bookkeeping()

    # ---- invariants ----
    def check_integrity(self, table_refs: Optional[Mapping[int, int]] = None) -> None:
        """Raise AssertionError unless every block is exactly one of free (in the free queue, no
        hash), cached-evictable (in the Evictor, hashed) or referenced (in neither), the hash map
        and the blocks agree, and (given the number of block-table entries pointing at each block)
        every ref count equals its references. References to the null block are allowed and not
        counted; it is never queued, hashed or referenced."""
        free, waiting = set(self._free_queue), set(self.evictor)
        assert not free & waiting, f"blocks both free and cached-evictable: {sorted(free & waiting)}"
        for block in self.blocks:
            self._check_block(block, free, waiting, table_refs)
        assert self.null_block_id not in free | waiting
        if table_refs is not None:
            unknown = set(table_refs) - set(range(self.num_blocks)) - {self.null_block_id}
            assert not unknown, f"block tables point at blocks outside the pool: {sorted(unknown)}"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash
        children = Counter(b.parent_hash for b in self.blocks if b.block_hash is not None)
        assert children == self._num_children, "child counts disagree with the cached blocks"
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks

    def _check_block(self, block: Block, free: set[int], waiting: set[int],
                     table_refs: Optional[Mapping[int, int]]) -> None:
        i = block.block_id
        assert block.ref_cnt >= 0, f"block {i} has ref_cnt {block.ref_cnt}"
        assert (block.ref_cnt == 0) == (i in free or i in waiting), \
            f"block {i}: ref_cnt {block.ref_cnt} but queued={i in free or i in waiting}"
        assert (i in waiting) == (block.ref_cnt == 0 and block.block_hash is not None), \
            f"block {i}: hashed={block.block_hash is not None}, ref_cnt {block.ref_cnt}, evictable={i in waiting}"
        if block.block_hash is not None:
            assert self._cached.get(block.block_hash) == i
        if table_refs is not None:
            refs = table_refs.get(i, 0)
            assert block.ref_cnt == refs, f"block {i}: ref_cnt {block.ref_cnt} != {refs} table references"


def _later(a: Optional[float], b: Optional[float]) -> bool:
    """Whether expiry a outlasts expiry b (None: never expires)."""
    return b is not None and (a is None or a > b)
