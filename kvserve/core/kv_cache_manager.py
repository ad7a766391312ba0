"""KVCacheManager: block tables of every request, over one BlockPool (and a CPU pool for swap).

The scheduler asks it three things: which prefix of a new request is already cached
(`find_cached_prefix`), whether a request can grow by n tokens (`allocate_slots`, which also
hashes blocks as they fill), and to let a request go (`free`, `swap_out`, `swap_in`).
Copies it decides on (copy-on-write, swaps) are queued for the runner as (src, dst) block pairs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from kvserve.core.block_hash import BlockHash, hash_full_blocks, root_hash
from kvserve.core.block_math import block_offset, num_blocks_for, num_full_blocks
from kvserve.core.block_pool import BlockPool
from kvserve.core.request import Request


@dataclass
class BlockCopies:
    """Block copies the runner performs before the step's forward pass, in this order."""

    swap_out: list[tuple[int, int]]  # (device block, cpu block)
    swap_in: list[tuple[int, int]]  # (cpu block, device block)
    copy_on_write: list[tuple[int, int]]  # (shared device block, its private copy)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy_on_write)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_cpu_blocks: int = 0, namespace: Sequence[object] = ()) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, False) if num_cpu_blocks > 0 else None
        self.namespace = tuple(namespace)  # model id, dtype, kv dtype, adapter
        self.req_blocks: dict[str, list[int]] = {}
        self.swapped_blocks: dict[str, list[int]] = {}
        self._num_hashed_blocks: dict[str, int] = {}
        self._copies = BlockCopies([], [], [])
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    # ---- queries ----
    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def num_reserved_slots(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ())) * self.block_size

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        q = self.num_prefix_query_tokens
        return self.num_prefix_hit_tokens / q if q else 0.0

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached blocks matching the request's first tokens, and the number
        of tokens they cover. At most num_tokens - 1 tokens: the last must be computed for logits."""
        if not self.enable_caching:
            return [], 0
        self._extend_hashes(request)
        limit = num_full_blocks(request.num_tokens - 1, self.block_size)
        tokens, bs = request.all_token_ids, self.block_size
        parent, hits = self._root(request), []
        for i, block_hash in enumerate(request.block_hashes[:limit]):
            block_id = self.pool.lookup(block_hash, parent, tuple(tokens[i * bs:(i + 1) * bs]))
            if block_id is None:
                break
            hits.append(block_id)
            parent = block_hash
        return hits, len(hits) * bs

    # ---- mutations ----
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: Sequence[int] = ()) -> bool:
        """Make room for num_new_tokens more tokens of the request (after its cached prefix,
        given on admission). Returns False, changing nothing, when the pool is too small."""
        rid, bs = request.request_id, self.block_size
        blocks = self.req_blocks.setdefault(rid, [])
        num_computed = request.num_computed_tokens + len(cached_blocks) * bs
        num_new_blocks = num_blocks_for(num_computed + num_new_tokens, bs) - len(blocks) - len(cached_blocks)
        needs_copy = self._needs_copy_on_write(blocks, num_computed, num_new_tokens)
        num_revived = sum(1 for b in cached_blocks if self.pool.is_evictable(b))
        if not self.pool.can_take(max(num_new_blocks, 0) + needs_copy + num_revived):
            if not blocks:
                del self.req_blocks[rid]
            return False
        if cached_blocks:
            self.pool.ref(cached_blocks)
            blocks.extend(cached_blocks)
            self._num_hashed_blocks[rid] = len(cached_blocks)
        if needs_copy:
            self._copy_last_block(blocks)
        blocks.extend(self.pool.take(max(num_new_blocks, 0)))
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return True

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_query_tokens += num_query_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first; hashed ones stay cached until evicted."""
        rid = request.request_id
        self.pool.release(reversed(self.req_blocks.pop(rid, [])))
        if self.cpu_pool is not None:
            self.cpu_pool.release(self.swapped_blocks.pop(rid, []))
        self._num_hashed_blocks.pop(rid, None)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent; the first write into a shared partial
        block copies it (copy-on-write)."""
        blocks = list(self.req_blocks.get(parent.request_id, []))
        self.pool.ref(blocks)
        self.req_blocks[child.request_id] = blocks
        self._num_hashed_blocks[child.request_id] = self._num_hashed_blocks.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def swap_out(self, request: Request) -> bool:
        """Move the request's blocks to the CPU pool; False if it has no room."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        if self.cpu_pool is None or not self.cpu_pool.can_take(len(blocks)):
            return False
        cpu_blocks = self.cpu_pool.take(len(blocks))
        self._copies.swap_out.extend(zip(blocks, cpu_blocks))
        self.pool.release(reversed(self.req_blocks.pop(rid)))
        self._num_hashed_blocks.pop(rid, None)
        self.swapped_blocks[rid] = cpu_blocks
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Bring a swapped request back and make room for num_new_tokens; False, changing
        nothing, when the pool cannot hold it."""
        rid = request.request_id
        cpu_blocks = self.swapped_blocks.get(rid, [])
        total = num_blocks_for(request.num_computed_tokens + num_new_tokens, self.block_size)
        if not self.pool.can_take(max(total, len(cpu_blocks))):
            return False
        assert self.cpu_pool is not None
        blocks = self.pool.take(len(cpu_blocks))
        self._copies.swap_in.extend(zip(cpu_blocks, blocks))
        self.cpu_pool.release(self.swapped_blocks.pop(rid))
        self.req_blocks[rid] = blocks
        self._num_hashed_blocks[rid] = 0
        allocated = self.allocate_slots(request, num_new_tokens)
        assert allocated
        return True

    def take_copies(self) -> BlockCopies:
        copies, self._copies = self._copies, BlockCopies([], [], [])
        return copies

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    # ---- invariants ----
    def check_integrity(self) -> None:
        """Every ref count equals the block tables pointing at the block, in both pools."""
        self.pool.check_integrity(Counter(b for t in self.req_blocks.values() for b in t))
        if self.cpu_pool is not None:
            self.cpu_pool.check_integrity(Counter(b for t in self.swapped_blocks.values() for b in t))

    # ---- helpers ----
    def _root(self, request: Request) -> BlockHash:
        return root_hash(*self.namespace, request.cache_salt)

    def _extend_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else self._root(request)
        hashes.extend(hash_full_blocks(parent, request.all_token_ids, self.block_size, len(hashes)))

    def _needs_copy_on_write(self, blocks: list[int], num_computed: int, num_new: int) -> bool:
        """Writing into a partially filled last block that another table shares."""
        return (num_new > 0 and bool(blocks) and block_offset(num_computed, self.block_size) != 0
                and self.pool.blocks[blocks[-1]].ref_cnt > 1)

    def _copy_last_block(self, blocks: list[int]) -> None:
        shared = blocks[-1]
        (private,) = self.pool.take(1)
        self._copies.copy_on_write.append((shared, private))
        self.pool.release([shared])
        blocks[-1] = private

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash and register the blocks that num_tokens fill (their K/V is written this step)."""
        if not self.enable_caching:
            return
        rid, bs = request.request_id, self.block_size
        start, end = self._num_hashed_blocks.get(rid, 0), num_full_blocks(num_tokens, bs)
        if end <= start:
            return
        self._extend_hashes(request)
        blocks, tokens = self.req_blocks[rid], request.all_token_ids
        for i in range(start, end):
            parent = request.block_hashes[i - 1] if i else self._root(request)
            self.pool.cache(blocks[i], request.block_hashes[i], parent,
                            tuple(tokens[i * bs:(i + 1) * bs]))
        self._num_hashed_blocks[rid] = end

