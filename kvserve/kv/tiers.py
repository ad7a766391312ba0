"""Tiers below the pool: byte stores that keep prefix blocks the pool evicted, by block name.

    pool (device)  --evicted-->  HostTier (RAM, bounded bytes)  and  DiskTier (files, bounded bytes)
                   <--loaded---  a prefix lookup that misses the pool continues here

A tier keeps `TierBlock`s: a block's name in the pool (its chain hash and cache group), its
parent's name, its token ids and its K/V as the storage's bytes (`KVStorage.read_block`), with
the facts the pool's eviction policy ranks a block by (`BlockFacts`: depth, hits, retention,
user priority) as the pool's block had them when it was written down. Past its byte budget a
tier forgets blocks in the order the pool's own policy object would (`kvserve.core.eviction`:
lru, fifo, priority, cost; retention priority first): each stored block has a `Block` record
whose stamps count the tier's own events (stored: `cached_at`, read: `last_used`) and whose
leaf test asks whether the tier holds its continuation. The tiers know nothing of
models or requests: kvserve.engine.offload wires them to the pool and checks what they return
against the hash chain before any of it is served.

Disk layout: one directory per namespace (model, dtype, KV format, block layout), one file per
block, named by the block's name in hex:

    DIR/<namespace>/namespace.json       what the namespace is, for people
    DIR/<namespace>/<name hex>.kvb       MAGIC | header | name | parent | tokens (int64) | bytes

The header carries the lengths and a CRC-32 of the bytes, so a truncated or corrupt file is
found on read, skipped with a warning and removed, never served. Files are written to a
temporary name and renamed, so a crash mid-write leaves no half file under a block's name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from kvserve.core.eviction import Block, EvictionPolicy, Evictor, LRUPolicy

logger = logging.getLogger("kvserve")

MAGIC = b"KVSBLK01"
HEADER = struct.Struct("<HHIQI")  # name length, parent length, token count, byte count, crc32
SUFFIX = ".kvb"


@dataclass(frozen=True)
class BlockFacts:
    """What the eviction policies know of a block besides the tier's own stamps, carried from
    the pool's block when it is written down (`kvserve.core.eviction.Block` has the meanings)."""

    depth: int = 0  # blocks before it in its prefix chain
    num_hits: int = 0  # prefix hits while cached in the pool (a tier's reads add to it)
    retention_priority: Optional[int] = None  # None: the default
    retention_expiry: Optional[float] = None  # on the pool's clock; None: never
    user_priority: Optional[int] = None  # the most important scheduling priority that used it

    @classmethod
    def of(cls, block: Block) -> "BlockFacts":
        return cls(block.depth, block.num_hits, block.retention_priority, block.retention_expiry,
                   block.user_priority)


@dataclass(frozen=True)
class TierBlock:
    name: bytes  # the block's name in the pool: chain hash and cache group
    parent: bytes  # the parent block's name (the namespace root's for a first block)
    token_ids: tuple[int, ...]
    data: torch.Tensor  # [bytes_per_block] uint8, on the CPU
    facts: BlockFacts = field(default_factory=BlockFacts, compare=False)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class Tier(ABC):
    """A bounded store of blocks by name; past its budget it forgets blocks in the order its
    eviction policy ranks them (retention priority first, as the pool's Evictor does). Thread-safe:
    the engine reads while a background writer puts."""

    medium: str  # as KV events name it: "CPU", "DISK"

    def __init__(self, max_bytes: int, policy: Optional[EvictionPolicy] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_hits = 0
        self._sizes: dict[bytes, int] = {}  # name -> bytes, in the order stored
        self._ids: dict[bytes, int] = {}  # name -> its record's index in _records
        self._records: list[Block] = []  # the policy's view of each stored block, by record index
        self._unused_ids: list[int] = []  # record indices free for the next block
        self._num_children: Counter[bytes] = Counter()  # stored blocks whose parent has this name
        self._stamp = 0  # the tier's event counter: stores and reads
        self._clock = clock
        self.evictor = Evictor(policy or LRUPolicy(), self._records, clock, self._is_leaf)
        self._lock = threading.RLock()

    @property
    def eviction_policy(self) -> str:
        return self.evictor.policy.name

    def __contains__(self, name: bytes) -> bool:
        with self._lock:
            return name in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def names(self) -> list[bytes]:
        """The names held, in the order stored."""
        with self._lock:
            return list(self._sizes)

    def get(self, name: bytes) -> Optional[TierBlock]:
        """The block, now read most recently; None if absent (or, on disk, unreadable)."""
        with self._lock:
            if name not in self._sizes:
                return None
            block = self._read(name)
            if block is None:
                self._drop(name)
                return None
            record = self._records[self._ids[name]]
            if record.parent_hash is None:  # found on disk at start: its parent is known now
                self._link(record, block.parent)
            record.num_hits += 1
            self._touch(record)
            self.num_hits += 1
            return block

    def put(self, block: TierBlock) -> list[bytes]:
        """Keep the block (a name already held takes the new facts and counts as read); returns
        the names forgotten to make room. A block larger than the whole budget is not kept."""
        with self._lock:
            if block.name in self._sizes:
                record = self._records[self._ids[block.name]]
                if record.parent_hash is None:  # found on disk at start and never read
                    self._link(record, block.parent)
                _merge_facts(record, block.facts, self._clock())
                self._touch(record)
                return []
            cost = self.cost(block)
            if cost > self.max_bytes:
                return []
            evicted = []
            while self.num_bytes + cost > self.max_bytes:
                evicted.append(self._evict_one())
            self._write(block)
            self._index(block.name, cost, block.parent, block.facts)
            return evicted

    def cost(self, block: TierBlock) -> int:
        """The bytes the block counts against the budget."""
        return block.nbytes

    def clear(self) -> None:
        with self._lock:
            for name in list(self._sizes):
                self._drop(name)

    # ---- the policy's records ----
    def _index(self, name: bytes, cost: int, parent: Optional[bytes], facts: BlockFacts) -> None:
        """Count a stored block and give the policy its record (stamped stored and read now)."""
        record_id = self._unused_ids.pop() if self._unused_ids else len(self._records)
        if record_id == len(self._records):
            self._records.append(Block(record_id))
        record = self._records[record_id]
        record.block_hash, record.parent_hash = name, None
        _set_facts(record, facts)
        record.cached_at = record.last_used = self._next_stamp()
        self._ids[name] = record_id
        self._sizes[name] = cost
        self.num_bytes += cost
        if parent is not None:
            self._link(record, parent)
        self.evictor.add(record)

    def _link(self, record: Block, parent: bytes) -> None:
        """The record's parent is known: the parent, if held, is no longer a leaf."""
        record.parent_hash = parent
        self._num_children[parent] += 1
        self._rerank(parent)

    def _touch(self, record: Block) -> None:
        """A read: the record is ranked afresh, as a pool block released after a hit."""
        record.last_used = self._next_stamp()
        self.evictor.remove(record.block_id)
        self.evictor.add(record)

    def _rerank(self, name: bytes) -> None:
        if name in self._ids:
            self.evictor.rerank(self._ids[name])

    def _is_leaf(self, record: Block) -> bool:
        """Whether the tier holds no block continuing its prefix chain."""
        return record.block_hash is None or self._num_children[record.block_hash] == 0

    def _next_stamp(self) -> int:
        self._stamp += 1
        return self._stamp

    def _evict_one(self) -> bytes:
        """Forget the block the policy ranks first; returns its name."""
        record = self._records[self.evictor.pop_victim()]
        assert record.block_hash is not None
        name = record.block_hash
        self._drop(name)
        return name

    def _drop(self, name: bytes) -> None:
        self.num_bytes -= self._sizes.pop(name)
        record_id = self._ids.pop(name)
        record = self._records[record_id]
        if record_id in self.evictor:
            self.evictor.remove(record_id)
        if record.parent_hash is not None:
            self._num_children[record.parent_hash] -= 1
            if not self._num_children[record.parent_hash]:
                del self._num_children[record.parent_hash]
                self._rerank(record.parent_hash)  # now a leaf
        record.block_hash = record.parent_hash = None
        record.reset_bookkeeping()
        self._unused_ids.append(record_id)
        self._delete(name)

    @abstractmethod
    def _read(self, name: bytes) -> Optional[TierBlock]: ...

    @abstractmethod
    def _write(self, block: TierBlock) -> None: ...

    @abstractmethod
    def _delete(self, name: bytes) -> None: ...

    def check_integrity(self) -> None:
        """The byte count equals the blocks' sizes and stays within the budget; every block held
        has exactly one record, waiting in the evictor, and the child counts match the records."""
        with self._lock:
            assert self.num_bytes == sum(self._sizes.values()), f"{self.medium}: bytes counted wrongly"
            assert self.num_bytes <= self.max_bytes, f"{self.medium}: {self.num_bytes} > {self.max_bytes} bytes"
            assert set(self._ids) == set(self._sizes), f"{self.medium}: records and blocks disagree"
            assert set(self.evictor) == set(self._ids.values()), f"{self.medium}: evictor and records disagree"
            assert all(self._records[i].block_hash == n for n, i in self._ids.items())
            children = Counter(self._records[i].parent_hash for i in self._ids.values()
                               if self._records[i].parent_hash is not None)
            assert children == self._num_children, f"{self.medium}: child counts disagree with the records"


def _merge_facts(record: Block, facts: BlockFacts, now: float) -> None:
    """A block written down again (loaded back, then evicted from the pool once more): its hits
    add up, the most important user and the higher retention priority still asked win."""
    asked = record.asked_retention(now)
    num_hits = record.num_hits + facts.num_hits
    users = [u for u in (record.user_priority, facts.user_priority) if u is not None]
    if facts.retention_priority is not None and (asked is None or facts.retention_priority >= asked):
        record.retention_priority, record.retention_expiry = facts.retention_priority, facts.retention_expiry
    record.depth, record.num_hits, record.user_priority = facts.depth, num_hits, min(users, default=None)


def _set_facts(record: Block, facts: BlockFacts) -> None:
    record.depth, record.num_hits, record.user_priority = facts.depth, facts.num_hits, facts.user_priority
    record.retention_priority, record.retention_expiry = facts.retention_priority, facts.retention_expiry


class HostTier(Tier):
    """Blocks in host RAM, as the storage's bytes."""

    medium = "CPU"

    def __init__(self, max_bytes: int, policy: Optional[EvictionPolicy] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(max_bytes, policy, clock)
        self._blocks: dict[bytes, TierBlock] = {}

    def _read(self, name: bytes) -> Optional[TierBlock]:
        return self._blocks[name]

    def _write(self, block: TierBlock) -> None:
        self._blocks[block.name] = block

    def _delete(self, name: bytes) -> None:
        del self._blocks[name]

    def check_integrity(self) -> None:
        super().check_integrity()
        assert set(self._blocks) == set(self._sizes), "host tier: blocks and sizes disagree"


class DiskTier(Tier):
    """Blocks as files in `directory/namespace`; the files already there (an earlier run of the
    same namespace) are indexed at start, oldest first (stamped stored in that order, with default
    facts: the files keep no eviction facts), and read back only after a check."""

    medium = "DISK"

    def __init__(self, directory: str | os.PathLike[str], namespace: dict[str, object], max_bytes: int,
                 policy: Optional[EvictionPolicy] = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(max_bytes, policy, clock)
        self.root = Path(directory) / namespace_id(namespace)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "namespace.json").write_text(json.dumps(namespace, indent=1, sort_keys=True, default=str))
        self.num_skipped = 0  # files found unreadable (truncated, corrupt) and removed
        for name, size in self._existing():  # facts unknown: default ones, parents learnt on read
            self._index(name, size, None, BlockFacts())
        while self.num_bytes > self.max_bytes:  # a smaller budget than the last run's
            self._evict_one()

    def cost(self, block: TierBlock) -> int:
        """The file's size."""
        return len(MAGIC) + HEADER.size + len(block.name) + len(block.parent) + 8 * len(block.token_ids) + block.nbytes

    def path(self, name: bytes) -> Path:
        return self.root / (name.hex() + SUFFIX)

    def _existing(self) -> Iterator[tuple[bytes, int]]:
        """The block files already here, least recently written first."""
        files = sorted(self.root.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
        for p in files:
            try:
                name = bytes.fromhex(p.stem)
            except ValueError:
                continue  # not a block file of ours
            yield name, p.stat().st_size

    def _read(self, name: bytes) -> Optional[TierBlock]:
        p = self.path(name)
        try:
            raw = p.read_bytes()
            return decode_block(raw, name)
        except (OSError, ValueError) as e:
            logger.warning("skipping KV tier file %s: %s", p, e)
            self.num_skipped += 1
            return None

    def _write(self, block: TierBlock) -> None:
        p = self.path(block.name)
        tmp = p.with_suffix(f".tmp{threading.get_ident()}")
        tmp.write_bytes(encode_block(block))
        os.replace(tmp, p)

    def _delete(self, name: bytes) -> None:
        self.path(name).unlink(missing_ok=True)

    def check_integrity(self) -> None:
        """And the block files in the directory are exactly the blocks counted."""
        super().check_integrity()
        with self._lock:
            on_disk = {p.stem for p in self.root.glob("*" + SUFFIX)}
            assert on_disk == {n.hex() for n in self._sizes}, "disk tier: files and index disagree"


def namespace_id(namespace: dict[str, object]) -> str:
    """The directory name of a namespace: a hash of everything that shapes a block's bytes."""
    text = json.dumps(namespace, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def encode_block(block: TierBlock) -> bytes:
    data = block.data.numpy().tobytes()
    tokens = struct.pack(f"<{len(block.token_ids)}q", *block.token_ids)
    header = HEADER.pack(len(block.name), len(block.parent), len(block.token_ids), len(data), zlib.crc32(data))
    return MAGIC + header + block.name + block.parent + tokens + data


def decode_block(raw: bytes, name: bytes) -> TierBlock:
    """The block a file holds; ValueError naming what is wrong (truncated, corrupt, another block's)."""
    if raw[:len(MAGIC)] != MAGIC or len(raw) < len(MAGIC) + HEADER.size:
        raise ValueError("not a kvserve block file (bad magic or too short)")
    name_len, parent_len, num_tokens, num_bytes, crc = HEADER.unpack_from(raw, len(MAGIC))
    start = len(MAGIC) + HEADER.size
    expected = start + name_len + parent_len + 8 * num_tokens + num_bytes
    if len(raw) != expected:
        raise ValueError(f"truncated or overlong: {len(raw)} bytes, the header says {expected}")
    stored_name = raw[start:start + name_len]
    if stored_name != name:
        raise ValueError("the file holds another block than its name says")
    at = start + name_len
    parent = raw[at:at + parent_len]
    at += parent_len
    tokens = struct.unpack_from(f"<{num_tokens}q", raw, at)
    data = raw[at + 8 * num_tokens:]
    if zlib.crc32(data) != crc:
        raise ValueError("the block's bytes fail their checksum")
    return TierBlock(name, parent, tuple(tokens), torch.frombuffer(bytearray(data), dtype=torch.uint8))
