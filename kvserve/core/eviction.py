"""Which cached block goes when the pool must hand out a block and none is free.

The pool keeps its free blocks (no hash) apart from its cached-evictable ones (ref_cnt 0, hash
kept for prefix hits). Only when no free block is left does it evict a cached one, and the
`Evictor` chooses which: the block of the lowest retention priority first (a request may ask
that its prompt's blocks outlive others, `kvserve.core.retention`), and among equals the one its
`EvictionPolicy` ranks first. Every policy is a key over a block's bookkeeping, so one heap
serves them all:

    lru       the block released longest ago (a hit takes it out of the running)
    fifo      the block cached earliest, however recently it was read
    priority  the blocks of the least important users (scheduling priority) first, then LRU
    cost      leaves of a prefix chain first, then GreedyDual credit: a block's credit is the
              clock at its release plus (1 + hits) * (depth + 1), the prefix a prefill must run
              through to bring it back; each eviction advances the clock to the victim's credit,
              so one-off blocks age out while a much-read system prompt stays (scan resistance)

Keys are fixed while a block waits, except where noted: a retention duration running out (the
Evictor re-ranks the block at its default priority) and, under `cost`, a block becoming a leaf
when its last cached child is evicted (the pool tells the Evictor to re-rank it).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, Optional

from kvserve.config import EVICTION_POLICIES
from kvserve.core.block_hash import BlockHash
from kvserve.core.retention import DEFAULT_RETENTION_PRIORITY

Key = tuple[float, ...]


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None
    parent_hash: Optional[BlockHash] = None
    token_ids: Optional[tuple[int, ...]] = None  # set with the hash, compared on every hit
    # bookkeeping the eviction policies read (reset when the hash goes)
    retention_priority: Optional[int] = None  # 1-100 as a request asked, higher kept longer; None: default
    retention_expiry: Optional[float] = None  # clock time it falls back to the default; None: never
    user_priority: Optional[int] = None  # the most important (lowest) scheduling priority that used it
    cached_at: int = 0  # event stamp of its hash registration
    last_used: int = 0  # event stamp of its last release
    num_hits: int = 0  # prefix hits and forks that referenced it while cached
    depth: int = 0  # blocks before it in its prefix chain
    credit: float = 0.0  # GreedyDual credit (the cost policy)

    def asked_retention(self, now: float) -> Optional[int]:
        """The retention priority a request gave it that still holds at clock time `now`."""
        if self.retention_expiry is not None and now >= self.retention_expiry:
            return None
        return self.retention_priority

    def effective_retention(self, now: float) -> int:
        """Its retention priority at clock time `now` (the default where none was asked or its
        duration ran out)."""
        asked = self.asked_retention(now)
        return DEFAULT_RETENTION_PRIORITY if asked is None else asked

    def reset_bookkeeping(self) -> None:
        self.retention_priority, self.retention_expiry = None, None
        self.user_priority, self.num_hits, self.depth, self.credit = None, 0, 0, 0.0


class EvictionPolicy(ABC):
    """Ranks cached-evictable blocks: the smallest key is evicted first (after retention)."""

    name: ClassVar[str]

    def admit(self, block: Block, is_leaf: bool) -> None:
        """The block just became evictable (its last reference went); set what key() reads."""

    @abstractmethod
    def key(self, block: Block, is_leaf: bool) -> Key: ...

    def evicted(self, block: Block) -> None:
        """The block was chosen as a victim (before its bookkeeping is reset)."""


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def key(self, block: Block, is_leaf: bool) -> Key:
        return (block.last_used,)


class FIFOPolicy(EvictionPolicy):
    name = "fifo"

    def key(self, block: Block, is_leaf: bool) -> Key:
        return (block.cached_at,)


class UserPriorityPolicy(EvictionPolicy):
    """Higher-priority users keep their cache: a block is ranked by the most important request
    that used it (scheduling priority, lower is more important), least important first."""

    name = "priority"

    def key(self, block: Block, is_leaf: bool) -> Key:
        user = 0 if block.user_priority is None else block.user_priority
        return (-user, block.last_used)


class CostAwarePolicy(EvictionPolicy):
    """GreedyDual over prefix depth, leaves first (see the module docstring). A block with a
    cached child is never taken while a leaf waits: evicting it would strand the child, whose
    chain hash can no longer be reached."""

    name = "cost"

    def __init__(self) -> None:
        self.clock = 0.0  # GreedyDual's L: the credit of the last victim

    def admit(self, block: Block, is_leaf: bool) -> None:
        block.credit = self.clock + (1 + block.num_hits) * (block.depth + 1)

    def key(self, block: Block, is_leaf: bool) -> Key:
        return (0 if is_leaf else 1, block.credit, block.last_used)

    def evicted(self, block: Block) -> None:
        self.clock = max(self.clock, block.credit)


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRUPolicy, FIFOPolicy, UserPriorityPolicy,
                                                                 CostAwarePolicy)}
assert tuple(POLICIES) == EVICTION_POLICIES, "the option's choices (kvserve.config) and the policies differ"


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()


class Evictor:
    """The cached-evictable blocks, ranked (retention priority, policy key): a heap whose stale
    entries (a block taken back by a hit, or re-ranked) are skipped when they surface."""

    def __init__(self, policy: EvictionPolicy, blocks: list[Block], clock: Callable[[], float],
                 is_leaf: Callable[[Block], bool]) -> None:
        self.policy = policy
        self._blocks = blocks
        self._clock = clock
        self._is_leaf = is_leaf
        self._keys: dict[int, Key] = {}  # block id -> its current full key
        self._heap: list[tuple[Key, int]] = []
        self._expiring: list[tuple[float, int]] = []  # (expiry, block id) of waiting blocks with a duration
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._keys

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def add(self, block: Block) -> None:
        self.policy.admit(block, self._is_leaf(block))
        self._push(block, self._clock())
        if block.retention_expiry is not None:
            heapq.heappush(self._expiring, (block.retention_expiry, block.block_id))

    def remove(self, block_id: int) -> None:
        """A hit takes the block back (or its hash went): it is no longer a candidate."""
        del self._keys[block_id]

    def rerank(self, block_id: int) -> None:
        """A waiting block's key may have changed (its retention, or under `cost` whether it is a
        leaf); a block that is not waiting is left alone."""
        if block_id in self._keys:
            block = self._blocks[block_id]
            self._push(block, self._clock())
            if block.retention_expiry is not None:
                heapq.heappush(self._expiring, (block.retention_expiry, block_id))

    def pop_victim(self) -> int:
        """The block to evict now; it leaves the evictor (the pool drops its hash)."""
        now = self._clock()
        self._expire(now)
        while self._heap:
            key, block_id = heapq.heappop(self._heap)
            if self._keys.get(block_id) == key:
                del self._keys[block_id]
                self.policy.evicted(self._blocks[block_id])
                return block_id
        raise RuntimeError("no cached block to evict")

    def _push(self, block: Block, now: float) -> None:
        key = (block.effective_retention(now), *self.policy.key(block, self._is_leaf(block)), next(self._seq))
        self._keys[block.block_id] = key
        heapq.heappush(self._heap, (key, block.block_id))

    def _expire(self, now: float) -> None:
        """Re-rank waiting blocks whose retention duration ran out at their default priority."""
        while self._expiring and self._expiring[0][0] <= now:
            expiry, block_id = heapq.heappop(self._expiring)
            block = self._blocks[block_id]
            if block_id in self._keys and block.retention_expiry == expiry:
                block.retention_priority, block.retention_expiry = None, None
                self._push(block, now)
