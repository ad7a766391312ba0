"""The tiers below the pool, wired to it: blocks the pool evicts go down, prefix hits come back.

    pool.take() evicts a cached block --on_removed--> its bytes copied out of the storage now
        (the block is about to be overwritten) --queue--> writer thread --> host tier, disk tier
    before each step, for the waiting requests: chain hashes --> pool? --> host? --> disk?
        a hit below the pool is written into a fresh block and registered under its name, so
        the scheduler's prefix lookup finds it and counts it as cached tokens

Only the copy out of the storage happens on the step's path; writing to RAM and disk (and the
tiers' own evictions) happens on the writer thread. A block waiting for the writer can already
be loaded back. What a tier returns is served only if its name, parent and token ids are the
ones the request's hash chain expects (the pool's own lookup rule), and its name is the hash of
its parent and tokens: a file from another model, KV format or salt has other names, and one
whose contents were changed is refused.

At shutdown (`flush`) the blocks still cached in the pool are written to the disk tier too, so a
new engine on the same directory starts with every prefix the old one held.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from kvserve.config import EngineConfig
from kvserve.core.block_hash import BlockHash, hash_block, hash_full_blocks, root_hash
from kvserve.core.block_math import num_full_blocks
from kvserve.core.cache_group import FullAttentionGroup
from kvserve.core.kv_cache_manager import KVCacheManager, block_name
from kvserve.core.request import Request
from kvserve.engine.kv_events import KVEventLog, group_of
from kvserve.kv.storage import BlockTensorStorage, KVStorage
from kvserve.core.eviction import make_policy
from kvserve.kv.tiers import BlockFacts, DiskTier, HostTier, Tier, TierBlock

logger = logging.getLogger("kvserve")


@dataclass
class TierStats:
    """Per tier: blocks served back into the pool and the time that took."""

    medium: str
    num_hit_blocks: int = 0
    num_stored_blocks: int = 0
    load_seconds: float = 0.0


@dataclass(frozen=True)
class TierSummary:
    """One tier as /metrics, /v1/kv/state and the dashboard show it."""

    medium: str
    num_blocks: int
    num_bytes: int
    max_bytes: int
    num_hit_blocks: int  # loaded back into the pool since start
    num_stored_blocks: int  # written into the tier since start
    load_seconds: float  # spent loading them back


@dataclass
class OffloadStats:
    tiers: dict[str, TierStats] = field(default_factory=dict)
    num_offloaded_blocks: int = 0  # copied out of the pool on eviction
    copy_seconds: float = 0.0  # spent on the step's path copying them out


class TieredPrefixCache:
    """The host and disk tiers under one pool (any of them may be absent)."""

    def __init__(self, kv: KVCacheManager, storage: KVStorage, tiers: Sequence[Tier],
                 events: Optional[KVEventLog] = None) -> None:
        if not isinstance(storage, BlockTensorStorage):
            raise ValueError(f"KV cache tiers need a block storage, not {type(storage).__name__}")
        if not all(isinstance(g, FullAttentionGroup) for g in kv.groups):
            raise ValueError("KV cache tiers serve full-attention caches only: this model has a sliding-window "
                             "cache group (--kv-cache-host-bytes, --kv-cache-dir)")
        self.kv, self.storage, self.tiers, self.events = kv, storage, list(tiers), events
        self.stats = OffloadStats({t.medium: TierStats(t.medium) for t in self.tiers})
        self._pending: dict[bytes, TierBlock] = {}  # copied out, not yet in every tier
        self._lock = threading.Lock()
        self._queue: queue.Queue[Optional[TierBlock]] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-tiers", daemon=True)
        self._writer.start()
        self._stops = [kv.pool.on_evict.add(self._evicted), kv.pool.on_reset.add(self.clear)]
        self._announce_kept()

    def _announce_kept(self) -> None:
        """The blocks a tier kept from an earlier run, as one BlockStored per tier (their names
        only: parents and tokens are read from the files when a request needs them)."""
        for tier in self.tiers:
            names = tier.names()
            if names and self.events is not None:
                self.events.add("BlockStored", block_hashes=tuple(names), block_size=self.kv.block_size,
                                medium=tier.medium, group=group_of(names[0]))

    # ---- down: eviction ----
    def _evicted(self, block_id: int, block_hash: BlockHash) -> None:
        """The pool is about to reuse a cached block: copy its bytes out now, write them later."""
        block = self.kv.pool.blocks[block_id]
        assert block.block_hash == block_hash and block.parent_hash is not None and block.token_ids is not None
        t0 = time.perf_counter()
        entry = TierBlock(block.block_hash, block.parent_hash, block.token_ids,
                          self.storage.read_block(block.block_id), BlockFacts.of(block))
        self.stats.copy_seconds += time.perf_counter() - t0
        self.stats.num_offloaded_blocks += 1
        self._submit(entry)

    def _submit(self, entry: TierBlock) -> None:
        with self._lock:
            self._pending[entry.name] = entry
        self._queue.put(entry)

    def _write_loop(self) -> None:
        torch.set_num_threads(1)  # its copies run inline: no OpenMP pool beside the engine's (server/async_engine.py)
        while (entry := self._queue.get()) is not None:
            try:
                self._store(entry)
            except Exception:  # a full disk must not end the engine: the block is only not kept
                logger.exception("writing a KV block to the tiers failed")
            finally:
                with self._lock:
                    if self._pending.get(entry.name) is entry:
                        del self._pending[entry.name]
                self._queue.task_done()
        self._queue.task_done()

    def _store(self, entry: TierBlock) -> None:
        for tier in self.tiers:
            if entry.name in tier:
                tier.put(entry)  # touched: read again, its facts updated
                continue
            evicted = tier.put(entry)
            self.stats.tiers[tier.medium].num_stored_blocks += 1
            if self.events is not None:
                if evicted:
                    self.events.add("BlockRemoved", block_hashes=tuple(evicted), medium=tier.medium)
                if entry.name in tier:
                    self.events.add("BlockStored", block_hashes=(entry.name,), parent_block_hash=entry.parent,
                                    token_ids=entry.token_ids, block_size=self.kv.block_size,
                                    medium=tier.medium, group=group_of(entry.name))

    # ---- up: loading a prefix back ----
    def load_waiting(self, requests: Sequence[Request]) -> int:
        """Before a step: bring back into the pool the prefix blocks of these waiting requests
        that only a tier holds. Returns the blocks loaded."""
        return sum(self.load_prefix(r) for r in requests
                   if r.num_computed_tokens == 0 and r.sampling_params.prompt_logprobs is None)

    def load_prefix(self, request: Request) -> int:
        """Walk the request's hash chain: blocks the pool holds are pinned, the first ones it
        lacks are loaded from the tiers into fresh blocks, until a block no tier holds (or no
        free block is left). The blocks end cached and unreferenced, most recently used, so the
        scheduler's lookup takes them. Returns the blocks loaded."""
        pool, bs = self.kv.pool, self.kv.block_size
        tokens = request.all_token_ids
        parent = root_hash(*self.kv.namespace, *request.cache_keys)  # the manager's root: salt and adapter
        limit = num_full_blocks(request.num_tokens - 1, bs)  # the last token is always computed
        hashes = request.block_hashes  # the chain the cache manager extends too: each hashed once
        if len(hashes) < limit:
            hashes.extend(hash_full_blocks(hashes[-1] if hashes else parent, tokens[:limit * bs], bs, len(hashes)))
        pinned: list[int] = []  # referenced while the walk goes on, so loading never evicts them
        num_loaded = 0
        try:
            for i, chain in enumerate(hashes[:limit]):
                block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
                name, parent_name = block_name(chain, 0), block_name(parent, 0)
                block_id = pool.lookup(name, parent_name, block_tokens)
                if block_id is not None:
                    pool.ref([block_id])
                else:
                    block_id = self._load(name, parent_name, block_tokens)
                    if block_id is None:
                        break
                    num_loaded += 1
                pinned.append(block_id)
                parent = chain
        finally:
            pool.release(reversed(pinned))  # tail first, as a finished request's
        return num_loaded

    def _load(self, name: bytes, parent: bytes, tokens: tuple[int, ...]) -> Optional[int]:
        """A fresh block (referenced once) holding the tiers' copy of the named block,
        registered under its name; None where no tier holds it or no block is free."""
        pool = self.kv.pool
        if not pool.can_take(1):
            return None
        t0 = time.perf_counter()
        found = self._find(name, parent, tokens)
        if found is None:
            return None
        entry, medium = found
        [block_id] = pool.take(1)
        self.storage.write_block(block_id, entry.data)
        pool.cache(block_id, name, parent, tokens)
        stats = self.stats.tiers[medium]
        stats.num_hit_blocks += 1
        stats.load_seconds += time.perf_counter() - t0
        return block_id

    def _find(self, name: bytes, parent: bytes, tokens: tuple[int, ...]) -> Optional[tuple[TierBlock, str]]:
        """The block from the highest tier holding it (a block still queued counts as the
        first tier's), if it is the one the chain expects."""
        with self._lock:
            entry = self._pending.get(name)
        if entry is not None and self.tiers:
            return (entry, self.tiers[0].medium) if is_expected(entry, name, parent, tokens) else None
        for tier in self.tiers:
            entry = tier.get(name)
            if entry is None:
                continue
            if is_expected(entry, name, parent, tokens):
                return entry, tier.medium
            logger.warning("a %s tier block does not match its hash chain; not served", tier.medium)
        return None

    def summary(self) -> tuple[TierSummary, ...]:
        return tuple(TierSummary(t.medium, len(t), t.num_bytes, t.max_bytes, s.num_hit_blocks, s.num_stored_blocks,
                                 s.load_seconds) for t in self.tiers for s in [self.stats.tiers[t.medium]])

    # ---- lifetime ----
    def flush(self) -> None:
        """Write the pool's cached blocks to the tiers too and wait until every write is done
        (at shutdown: a later engine on the same directory finds them)."""
        if any(isinstance(t, DiskTier) for t in self.tiers):
            for block in self.kv.pool.blocks:
                if block.block_hash is not None and not any(block.block_hash in t for t in self.tiers):
                    self._evicted(block.block_id, block.block_hash)
        self._queue.join()

    def close(self) -> None:
        self.flush()
        for stop in self._stops:
            stop()
        self._queue.put(None)
        self._writer.join()

    def clear(self) -> None:
        """Every tier forgets everything (the pool's cache was reset: new weights)."""
        self._queue.join()
        for tier in self.tiers:
            tier.clear()
        if self.events is not None:  # after the writer's last events: consumers drop everything again
            self.events.add("AllBlocksCleared")

    def check_integrity(self) -> None:
        """Between steps, once the writer is idle: every tier's count matches what it holds and
        no block is left half way (queued but never stored)."""
        self._queue.join()
        with self._lock:
            assert not self._pending, f"{len(self._pending)} evicted blocks never reached the tiers"
        for tier in self.tiers:
            tier.check_integrity()


def is_expected(entry: TierBlock, name: bytes, parent: bytes, tokens: tuple[int, ...]) -> bool:
    """Whether a tier's block is the one the chain names: same name, parent and tokens, and the
    name is the hash of the parent and the tokens (in the same cache group)."""
    if entry.name != name or entry.parent != parent or entry.token_ids != tokens:
        return False
    group = group_of(name)
    return block_name(hash_block(parent_chain(parent), tokens), group) == name and group_of(parent) == group


def parent_chain(name: bytes) -> BlockHash:
    return name[:-2]


def cache_namespace(config: EngineConfig, model_id: str, storage: BlockTensorStorage) -> dict[str, object]:
    """Everything that shapes a block's bytes: a disk tier keeps each namespace apart."""
    parts = {name: [list(shape), str(dtype)] for name, (shape, dtype) in storage.parts.items()}
    namespace: dict[str, object] = {
        "model": model_id, "dtype": config.dtype, "kv_cache_dtype": config.kv_cache_dtype,
        "block_size": storage.block_size, "layer_sets": len(storage.tensors), "parts": parts,
        "bytes_per_block": storage.bytes_per_block}
    scales = getattr(storage, "scales", None)  # fp8 codes mean nothing under other scales
    if isinstance(scales, torch.Tensor):
        namespace["scales_sha256"] = hashlib.sha256(scales.float().cpu().numpy().tobytes()).hexdigest()
    return namespace


def build_tiers(config: EngineConfig, kv: KVCacheManager, storage: Optional[KVStorage], model_id: str,
                events: Optional[KVEventLog]) -> Optional[TieredPrefixCache]:
    """The tiers the options ask for (None: none asked, or no prefix caching to feed them)."""
    c = config.cache
    if not c.host_bytes and c.disk_dir is None:
        return None
    if storage is None or not kv.enable_caching:
        raise ValueError("KV cache tiers keep prefix-cache blocks: they need the paged cache with prefix caching "
                         "(drop --kv-cache-host-bytes and --kv-cache-dir, or --no-cache/--no-prefix-caching)")
    if not isinstance(storage, BlockTensorStorage):
        raise ValueError(f"KV cache tiers need a block storage, not {type(storage).__name__}")
    if config.parallel.tensor_parallel_size > 1:  # each rank holds its share of every block
        raise ValueError("KV cache tiers are not served with tensor parallelism yet "
                         "(drop --kv-cache-host-bytes and --kv-cache-dir)")
    tiers: list[Tier] = []  # each ranks its blocks by a policy object of the pool's kind, on the pool's clock
    if c.host_bytes:
        tiers.append(HostTier(c.host_bytes, make_policy(kv.pool.eviction_policy), kv.pool.clock))
    if c.disk_dir is not None:
        tiers.append(DiskTier(c.disk_dir, cache_namespace(config, model_id, storage), c.disk_bytes,
                              make_policy(kv.pool.eviction_policy), kv.pool.clock))
    return TieredPrefixCache(kv, storage, tiers, events)
