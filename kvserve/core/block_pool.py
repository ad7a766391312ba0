"""BlockPool: every physical KV block, its reference count and its prefix-cache identity.

Each of the `num_blocks` blocks (ids 0 .. num_blocks - 1) is exactly one of:
  free              ref_cnt 0, no hash          -> at the front of the free queue
  cached-evictable  ref_cnt 0, hash registered  -> in the free queue, least recently freed first
  referenced        ref_cnt > 0                 -> in one or more block tables, not in the queue

One more block, the null block (id `num_blocks`), belongs to nobody: block tables hold it where a
position's block was given back (a sliding window moved past it) and where a batch pads a short
table. It is never handed out, hashed or counted, and the cache keeps it all zeros, so reading it
through a padded table is harmless. A pool for swapped-out blocks has none.

The free queue is an OrderedDict used as a doubly linked list: taking the head, appending to the
tail and (on a prefix-cache hit) removing a block from the middle are all O(1). Taking a block
from the head evicts its hash, so eviction is least-recently-used among cached blocks, and blocks
that hold nothing reusable are handed out before any cached one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from kvserve.core.block_hash import BlockHash


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None
    parent_hash: Optional[BlockHash] = None
    token_ids: Optional[tuple[int, ...]] = None  # set with the hash, compared on every hit


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, null_block: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.null_block_id: Optional[int] = num_blocks if null_block else None
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0
        self.released: list[int] = []  # blocks that reached ref_cnt 0 since take_released()

    # ---- queries (never mutate) ----
    @property
    def num_physical_blocks(self) -> int:
        """Blocks the cache tensors hold: the pool's blocks and the null block."""
        return self.num_blocks + (self.null_block_id is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free plus cached-evictable."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    def can_take(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free_queue)

    def is_evictable(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_cnt == 0

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
        """Hand out num_blocks blocks with ref_cnt 1, evicting cached ones from the queue head."""
        if not self.can_take(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
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
                del self._free_queue[block_id]
            block.ref_cnt += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """One block table fewer points at each block; a block reaching zero joins the queue.
        The null block is skipped, as in `ref`.

        Callers pass a sequence's blocks tail first, so its last blocks are evicted before its
        first ones, which more requests are likely to share.
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
                self._free_queue[block_id] = None
                if block.block_hash is None:
                    self._free_queue.move_to_end(block_id, last=False)

    def cache(self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash,
              token_ids: tuple[int, ...]) -> None:
        """Register a full block under its hash; a hash already held by another block is kept."""
        block = self.blocks[block_id]
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached[block_hash] = block_id

    def take_released(self) -> list[int]:
        """The blocks nobody references any more since the last call (a storage that keeps state
        per block, such as int4's open blocks, forgets theirs)."""
        released, self.released = self.released, []
        return released

    def forget_hash(self, block_id: int) -> None:
        """Unregister a block that its only holder is about to overwrite (after a rollback)."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = block.parent_hash = block.token_ids = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after new weights are loaded)."""
        for block in self.blocks:
            if block.block_hash is not None:
                self._evict(block)

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        del self._cached[block.block_hash]
        block.block_hash = block.parent_hash = block.token_ids = None
        self.num_evictions += 1

    # ---- invariants ----
    def check_integrity(self, table_refs: Optional[Mapping[int, int]] = None) -> None:
        """Raise AssertionError unless every block is exactly one of free, cached-evictable or
        referenced, the hash map and the blocks agree, and (given the number of block-table
        entries pointing at each block) every ref count equals its references. References to
        the null block are allowed and not counted; it is never queued, hashed or referenced."""
        queued = set(self._free_queue)
        assert len(queued) == len(self._free_queue)
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in queued), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but queued={block.block_id in queued}"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id
            if table_refs is not None:
                refs = table_refs.get(block.block_id, 0)
                assert block.ref_cnt == refs, \
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs} table references"
        assert self.null_block_id not in queued
        if table_refs is not None:
            unknown = set(table_refs) - set(range(self.num_blocks)) - {self.null_block_id}
            assert not unknown, f"block tables point at blocks outside the pool: {sorted(unknown)}"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
