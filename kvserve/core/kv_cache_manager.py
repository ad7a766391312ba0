"""KVCacheManager: every request's block tables (one per cache group) over one BlockPool, and a
CPU pool for swap.

The scheduler asks it which prefix of a new request is already cached (`find_cached_prefix`),
whether a request can grow by n tokens (`allocate_slots`, which also registers blocks as they
fill), and to let a request go (`free`, `swap_out`, `swap_in`) or take tokens back (`trim`).
Copies it decides on (copy-on-write, swaps) are queued for the runner as (src, dst) block pairs;
`take_table_updates` hands the runner only the table entries that changed.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence
import time

from kvserve.core.block_hash import BlockHash, hash_full_blocks, root_hash
from kvserve.core.block_math import num_blocks_for, num_full_blocks
from kvserve.core.block_pool import BlockPool
from kvserve.core.cache_group import CacheGroup, CacheGroupSpec, FullAttentionGroup, make_group
from kvserve.core.request import Request
from kvserve.core.retention import block_retention

TableUpdate = Optional[tuple[int, list[int]]]  # (first changed entry, entries from there on)


@dataclass
class BlockCopies:
    """What the runner does to the cache's blocks before the step's forward pass, in this
    order: swap out, forget released blocks, swap in, copy on write."""

    swap_out: list[tuple[int, int]]  # (device block, cpu block)
    swap_in: list[tuple[int, int]]  # (cpu block, device block)
    copy_on_write: list[tuple[int, int]]  # (shared device block, its private copy)
    released: list[int] = field(default_factory=list)  # device blocks nobody references now
    released_cpu: list[int] = field(default_factory=list)  # likewise in the CPU pool

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy_on_write or self.released or self.released_cpu)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_cpu_blocks: int = 0, namespace: Sequence[object] = (),
                 groups: Sequence[CacheGroupSpec] = (CacheGroupSpec("full", ()),), step_tokens: int = 1,
                 eviction_policy: str = "lru", clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.step_tokens = step_tokens  # the most tokens of one sequence computed in a step
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, eviction_policy=eviction_policy, clock=clock)
        self.cpu_pool = BlockPool(num_cpu_blocks, False, null_block=False) if num_cpu_blocks > 0 else None
        self.groups: list[CacheGroup] = [make_group(i, s, self.pool, block_size) for i, s in enumerate(groups)]
        self.namespace = tuple(namespace)  # model id, dtype, kv dtype, adapter
        self.swapped_blocks: dict[str, list[list[int]]] = {}  # per group: the held blocks, in table order
        self._swapped_len: dict[str, list[list[bool]]] = {}  # per group: which table entries were held
        self._num_hashed_blocks: dict[str, int] = {}
        self._copies = BlockCopies([], [], [])
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_swaps_out = 0  # requests moved to the CPU pool since start
        self.num_swaps_in = 0  # and brought back

    # ---- queries ----
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def null_block(self) -> int:
        assert self.pool.null_block_id is not None
        return self.pool.null_block_id

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        return self.groups[group].table(request_id)

    def num_held_blocks(self, request_id: str) -> int:
        """Pool blocks the request holds, over all groups (its cache footprint)."""
        return sum(sum(1 for _ in g.held_blocks(request_id)) for g in self.groups)

    def num_reserved_slots(self, request_id: str) -> int:
        return self.num_held_blocks(request_id) * self.block_size

    def num_used_slots(self, request_id: str, num_computed: int) -> int:
        """Slots of the request's held blocks that hold a computed token, over all groups: the
        computed tokens the table covers, less the null entries (given back, always whole blocks
        behind the window). Counted at C speed: stats are taken every step."""
        bs, null = self.block_size, self.null_block
        return sum(min(num_computed, len(t) * bs) - bs * t.count(null)
                   for g in self.groups if (t := g.table(request_id)))

    def group_held_blocks(self) -> list[int]:
        """Per group, the pool blocks held by requests' tables (shared ones counted once)."""
        return [len(set(chain.from_iterable(g.tables.values())) - {self.null_block}) for g in self.groups]

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        q = self.num_prefix_query_tokens
        return self.num_prefix_hit_tokens / q if q else 0.0

    def blocks_needed(self, num_tokens: int, step_tokens: Optional[int] = None) -> int:
        """Pool blocks one sequence of num_tokens holds at most, over all groups, computing up to
        step_tokens a step (default: the most a step computes; 1: between steps, as a decoding
        sequence holds them): a sliding-window group holds its window's blocks and a step's only.
        What admission and sizing count."""
        step = self.step_tokens if step_tokens is None else step_tokens
        return sum(g.max_blocks_held(num_tokens, step) for g in self.groups)

    def group_blocks_needed(self, num_prompt_tokens: int, num_tokens: int, width: int,
                            step_tokens: Optional[int] = None) -> int:
        """Pool blocks a group of `width` sequences forked from one prompt (n samples, beams)
        holds at most when each grows to num_tokens: every member's own blocks, and the
        prompt's full blocks they share once. With block size 16, one full-attention group:

            prompt 40, 100 tokens, width 4:  7 blocks each, 2 shared:  2 + 4 * 5 == 22
        """
        per_sequence = self.blocks_needed(num_tokens, step_tokens)
        shared = sum(g.spec.num_shared_blocks(num_prompt_tokens, self.block_size) for g in self.groups)
        return shared + width * (per_sequence - shared)

    @property
    def has_window(self) -> bool:
        """Whether a step of fewer tokens holds fewer blocks (a window group gives back what its
        window passed once the step is done); under full attention every block stays anyway."""
        return any(g.spec.recent is not None for g in self.groups)

    def blocks_to_allocate(self, request: Request, num_new_tokens: int,
                           cached_blocks: Optional[Sequence[list[int]]] = None) -> int:
        """Pool blocks allocate_slots takes for these tokens now: new blocks, copies on write,
        and cached hits taken out of the evictable queue. Changes nothing."""
        rid = request.request_id
        cached = cached_blocks or [[] for _ in self.groups]
        num_computed = request.num_computed_tokens + len(cached[0]) * self.block_size
        total = num_computed + num_new_tokens
        needed = 0
        for g, blocks in zip(self.groups, cached):
            needed += max(num_blocks_for(total, self.block_size) - len(g.table(rid)) - len(blocks), 0)
            needed += g.needs_copy_on_write(rid, num_computed, num_new_tokens)
            needed += sum(1 for b in blocks if b != self.pool.null_block_id and self.pool.is_evictable(b))
        return needed

    def blocks_to_swap_in(self, request: Request, num_new_tokens: int) -> int:
        """Pool blocks swap_in asks to be free for a swapped request and num_new_tokens more."""
        held = sum(len(b) for b in self.swapped_blocks.get(request.request_id, []))
        return held + self.num_groups * num_blocks_for(num_new_tokens + self.block_size, self.block_size)

    def find_cached_prefix(self, request: Request, use_cache: bool = True) -> tuple[list[list[int]], int]:
        """The longest cached prefix of the request's tokens, as each group's first table entries,
        and the tokens it covers. Full-attention groups need every block of it cached; a
        sliding-window group only the blocks the next query's window reads (the entries before
        them are the null block). At most num_tokens - 1 tokens: the last must be computed for
        its logits. use_cache=False: no hit (the request still registers its blocks for others)."""
        no_hit: list[list[int]] = [[] for _ in self.groups]
        if not self.enable_caching or not use_cache:
            return no_hit, 0
        self._extend_hashes(request)
        limit = num_full_blocks(request.num_tokens - 1, self.block_size)
        found = self._cached_runs(request, limit)
        hit = next((n for n in range(limit, 0, -1) if all(
            all(i < len(found[g.index]) and found[g.index][i] is not None for i in g.needed(n * self.block_size, n))
            for g in self.groups)), 0)
        tables = []
        for g in self.groups:
            needed = set(g.needed(hit * self.block_size, hit))
            table = []
            for i in range(hit):
                b = found[g.index][i] if i in needed else self.null_block
                assert b is not None
                table.append(b)
            tables.append(table)
        return tables, hit * self.block_size

    def _cached_runs(self, request: Request, limit: int) -> list[list[Optional[int]]]:
        """Per group, the cached block of each of the first `limit` blocks (None: not cached). A
        full-attention group stops at its first miss (nothing past it can be used)."""
        tokens, bs = request.all_token_ids, self.block_size
        found: list[list[Optional[int]]] = [[] for _ in self.groups]
        for g in self.groups:
            parent = self._root(request)
            for i, block_hash in enumerate(request.block_hashes[:limit]):
                b = self.pool.lookup(_key(block_hash, g.index), _key(parent, g.index), tuple(tokens[i * bs:(i + 1) * bs]))
                found[g.index].append(b)
                if b is None and isinstance(g, FullAttentionGroup):
                    break
                parent = block_hash
        return found

    # ---- mutations ----
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: Optional[Sequence[list[int]]] = None) -> bool:
        """Make room for num_new_tokens more tokens of the request (after its cached prefix, one
        list per group, given on admission). Returns False, changing nothing, when the pool is
        too small. Blocks whose tokens are all known are registered for prefix caching as they
        are allocated: their K/V is written this step."""
        rid = request.request_id
        cached = cached_blocks or [[] for _ in self.groups]
        num_computed = request.num_computed_tokens + len(cached[0]) * self.block_size
        total = num_computed + num_new_tokens
        self.remove_skipped_blocks(request)  # what no later query reads goes back first
        if not self.pool.can_take(self.blocks_to_allocate(request, num_new_tokens, cached_blocks)):
            return False
        for g, blocks in zip(self.groups, cached):
            if blocks:
                g.add_cached(rid, blocks)
                self._retain(request, enumerate(blocks))
            if g.needs_copy_on_write(rid, num_computed, num_new_tokens):
                self._copies.copy_on_write.append(g.copy_last_block(rid))
            g.grow(rid, total)
        if cached[0]:
            self._num_hashed_blocks[rid] = len(cached[0])
        self._cache_full_blocks(request, min(total, request.num_tokens))
        return True

    def allocate_fitting(self, request: Request, num_new_tokens: int,
                         cached_blocks: Optional[Sequence[list[int]]] = None) -> int:
        """allocate_slots for as many of num_new_tokens as the pool can hold now: all of them, or
        where a window makes a shorter step hold fewer blocks, the most that fit (a long prompt
        goes through a small pool in chunks); returns how many (0: none, nothing changed).

            window 64 with 4 sinks, block size 16, a 1700-token prompt, 100 free blocks:
            all 1700 would take 107; the first 1600 take 100, after which the window gives
            back 95 of them (it keeps the sinks' block and the last 4) for the other 100
        """
        if self.allocate_slots(request, num_new_tokens, cached_blocks):
            return num_new_tokens
        if not self.has_window:
            return 0
        self.remove_skipped_blocks(request)
        fits, too_many = 0, num_new_tokens  # the largest count that fits lies in [fits, too_many)
        while too_many - fits > 1:
            mid = (fits + too_many) // 2
            if self.pool.can_take(self.blocks_to_allocate(request, mid, cached_blocks)):
                fits = mid
            else:
                too_many = mid
        return fits if fits and self.allocate_slots(request, fits, cached_blocks) else 0

    def holds_window_of(self, request: Request, num_tokens: int) -> bool:
        """Whether every block the query at position num_tokens reads is still held (a rollback
        past a sliding window's start would read blocks given back)."""
        end = num_blocks_for(num_tokens, self.block_size)
        return all(g.table(request.request_id)[i] != self.null_block for g in self.groups
                   for i in g.needed(num_tokens, min(end, len(g.table(request.request_id)))))

    def remove_skipped_blocks(self, request: Request) -> None:
        """Give back the blocks of sliding-window groups that the request's next query, at
        position num_computed_tokens, and every later one no longer read."""
        for g in self.groups:
            g.remove_skipped_blocks(request.request_id, request.num_computed_tokens)

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_query_tokens += num_query_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    def forget_own_hashes(self, request: Request) -> None:
        """Its blocks no other request holds are no longer offered to prefix caching (a failed
        step may have left them half written)."""
        null = self.null_block
        for g in self.groups:
            for b in g.table(request.request_id):
                if b != null and self.pool.blocks[b].ref_cnt == 1:
                    self.pool.forget_hash(b)

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first; hashed ones stay cached until evicted."""
        rid = request.request_id
        for g in self.groups:
            self.pool.release(reversed(g.pop(rid)))
        if self.cpu_pool is not None:
            for blocks in self.swapped_blocks.pop(rid, []):
                self.cpu_pool.release(blocks)
        self._swapped_len.pop(rid, None)
        self._num_hashed_blocks.pop(rid, None)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks num_tokens positions need (a rollback of proposed tokens or of
        output): the rest go back to the pool, and no block past num_tokens stays registered
        for this request."""
        rid = request.request_id
        for g in self.groups:
            g.trim(rid, num_tokens)
        if rid in self._num_hashed_blocks:
            self._num_hashed_blocks[rid] = min(self._num_hashed_blocks[rid],
                                               num_full_blocks(num_tokens, self.block_size))
        del request.block_hashes[num_full_blocks(request.num_tokens, self.block_size):]

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent; the first write into a shared partial
        block copies it (copy-on-write)."""
        for g in self.groups:
            g.fork(parent.request_id, child.request_id)
        self._num_hashed_blocks[child.request_id] = self._num_hashed_blocks.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def can_swap_out(self, request: Request) -> bool:
        """Whether the host pool has room for every block the request holds."""
        return self.cpu_pool is not None and self.cpu_pool.can_take(self.num_held_blocks(request.request_id))

    def swap_out(self, request: Request) -> bool:
        """Move the request's blocks to the CPU pool; False if it has no room."""
        rid = request.request_id
        tables = [list(g.held_blocks(rid)) for g in self.groups]
        if self.cpu_pool is None or not self.cpu_pool.can_take(sum(map(len, tables))):
            return False
        swapped, held = [], []
        for g, blocks in zip(self.groups, tables):
            cpu_blocks = self.cpu_pool.take(len(blocks))
            self._copies.swap_out.extend(zip(blocks, cpu_blocks))
            table = g.pop(rid)
            held.append([b != self.pool.null_block_id for b in table])
            self.pool.release(reversed(table))
            swapped.append(cpu_blocks)
        self._num_hashed_blocks.pop(rid, None)
        self.swapped_blocks[rid] = swapped
        self._swapped_len[rid] = held
        self.num_swaps_out += 1
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Bring a swapped request back and make room for num_new_tokens; False, changing
        nothing, when the pool cannot hold it."""
        rid = request.request_id
        swapped = self.swapped_blocks.get(rid, [[] for _ in self.groups])
        if not self.pool.can_take(self.blocks_to_swap_in(request, num_new_tokens)):
            return False
        assert self.cpu_pool is not None
        for g, cpu_blocks, held in zip(self.groups, swapped, self._swapped_len.pop(rid)):
            blocks = iter(self.pool.take(len(cpu_blocks)))
            table = [next(blocks) if h else self.null_block for h in held]
            self._copies.swap_in.extend(zip(cpu_blocks, [b for b in table if b != self.null_block]))
            self.cpu_pool.release(cpu_blocks)
            g.set_table(rid, table)
        del self.swapped_blocks[rid]
        self._num_hashed_blocks[rid] = 0
        self.num_swaps_in += 1
        allocated = self.allocate_slots(request, num_new_tokens)
        assert allocated
        return True

    def take_copies(self) -> BlockCopies:
        copies, self._copies = self._copies, BlockCopies([], [], [])
        copies.released = self.pool.take_released()
        if self.cpu_pool is not None:
            copies.released_cpu = self.cpu_pool.take_released()
        return copies

    def take_table_updates(self, request_id: str) -> tuple[TableUpdate, ...]:
        """Per group, the table entries that changed since the last call (None: none did)."""
        return tuple(g.take_update(request_id) for g in self.groups)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    # ---- invariants ----
    def check_integrity(self) -> None:
        """Every ref count equals the block tables pointing at the block, in both pools, and
        no request is both resident and swapped out."""
        refs = Counter(b for g in self.groups for t in g.tables.values() for b in t)
        self.pool.check_integrity(refs)
        if self.cpu_pool is not None:
            self.cpu_pool.check_integrity(Counter(b for ts in self.swapped_blocks.values() for t in ts for b in t))
        for g in self.groups:
            assert not set(g.tables) & set(self.swapped_blocks), "a request both resident and swapped"

    # ---- helpers ----
    def _root(self, request: Request) -> BlockHash:
        return root_hash(*self.namespace, *request.cache_keys)

    def _extend_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else self._root(request)
        hashes.extend(hash_full_blocks(parent, request.all_token_ids, self.block_size, len(hashes)))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that num_tokens (known tokens whose K/V is written this step)
        fill, in every group that holds them."""
        if not self.enable_caching:
            return
        rid, bs = request.request_id, self.block_size
        start, end = self._num_hashed_blocks.get(rid, 0), num_full_blocks(num_tokens, bs)
        if end <= start:
            return
        self._extend_hashes(request)
        tokens = request.all_token_ids
        for i in range(start, end):
            parent = request.block_hashes[i - 1] if i else self._root(request)
            for g in self.groups:
                block = g.table(rid)[i]
                if block != self.pool.null_block_id:
                    self.pool.cache(block, _key(request.block_hashes[i], g.index), _key(parent, g.index),
                                    tuple(tokens[i * bs:(i + 1) * bs]))
                    self._retain(request, [(i, block)])
        self._num_hashed_blocks[rid] = end

    def _retain(self, request: Request, blocks: Iterable[tuple[int, int]]) -> None:
        """The request's retention ranges and scheduling priority reach its cached blocks, given
        as (table entry, block id): entry i covers positions [i * block_size, (i + 1) * block_size)."""
        ranges, bs = request.sampling_params.kv_retention, self.block_size
        for i, block in blocks:
            if block != self.pool.null_block_id:
                self.pool.retain(block, block_retention(ranges, i * bs, (i + 1) * bs), request.priority)


def _key(block_hash: BlockHash, group: int) -> BlockHash:
    """A block's name in the pool: its chain hash in one group (each group caches its own)."""
    return block_hash + group.to_bytes(2, "little")


block_name = _key  # public: the tiers below the pool and KV events name blocks as the pool does
