"""KV events: what the prefix cache holds, told as it changes, so a router can send a request
where its prefix is (NVIDIA Dynamo's and llm-d's KV routers read the same stream from vLLM).

    BlockStored      block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium
    BlockRemoved     block_hashes, medium
    AllBlocksCleared

`medium` names where the block is: "GPU" for the pool (the engine's device, even on a CPU
device, as vLLM names its pool), "CPU" for the host tier, "DISK" for the disk tier. A block hash
is the block's name in the pool (`kvserve.engine.offload.block_name`: its chain hash and its cache
group), as bytes; the JSON endpoint gives it in hex and the cache group beside it.

Two ways out:
  - `KVEventLog.since(seq)`: numbered events for `GET /v1/kv/events?since=N` (a bounded
    backlog: a consumer that falls behind it is told to resynchronize from `/v1/kv/state`);
  - `ZmqPublisher` (`--kv-events tcp://*:5557`): at the end of each step the step's events as one
    msgpack-encoded KVEventBatch `[ts, [event, ...]]`, each event an array tagged by its type's
    name, sent as the multipart message (topic, sequence number as 8 big-endian bytes, payload),
    as vLLM's ZmqEventPublisher does.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from kvserve.core.block_pool import Block, BlockPool

MAX_BACKLOG = 20_000  # events kept for the endpoint


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: str  # "BlockStored", "BlockRemoved", "AllBlocksCleared"
    block_hashes: tuple[bytes, ...] = ()
    parent_block_hash: Optional[bytes] = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    medium: Optional[str] = None
    group: int = 0
    ts: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seq": self.seq, "type": self.kind, "ts": self.ts}
        if self.kind == "AllBlocksCleared":
            return out
        out.update(block_hashes=[h.hex() for h in self.block_hashes], medium=self.medium, group=self.group)
        if self.kind == "BlockStored":
            out.update(parent_block_hash=self.parent_block_hash.hex() if self.parent_block_hash else None,
                       token_ids=list(self.token_ids), block_size=self.block_size, lora_id=None)
        return out

    def to_wire(self) -> list[Any]:
        """The event as vLLM's msgspec structs encode it (array_like, tagged by class name)."""
        if self.kind == "BlockStored":
            return [self.kind, list(self.block_hashes), self.parent_block_hash, list(self.token_ids),
                    self.block_size, None, self.medium]
        if self.kind == "BlockRemoved":
            return [self.kind, list(self.block_hashes), self.medium]
        return [self.kind]


class KVEventLog:
    """Numbered events, kept for the endpoint and handed to the publishers at each step's end.
    Thread-safe: the tiers' writer thread adds events beside the engine's."""

    def __init__(self, max_backlog: int = MAX_BACKLOG) -> None:
        self._events: deque[KVEvent] = deque(maxlen=max_backlog)
        self._unpublished: list[KVEvent] = []
        self._next_seq = 0
        self._changed = threading.Condition()
        self.publishers: list[ZmqPublisher] = []
        self.epoch = uuid.uuid4().hex  # a consumer that sees another epoch knows the engine restarted

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def add(self, kind: str, **fields: Any) -> None:
        with self._changed:
            event = KVEvent(self._next_seq, kind, **fields)
            self._next_seq += 1
            self._events.append(event)
            self._unpublished.append(event)
            self._changed.notify_all()

    def since(self, seq: int) -> tuple[list[KVEvent], bool]:
        """The events numbered seq and on, and whether some of those are gone from the backlog
        (then the consumer rebuilds its view from a snapshot)."""
        with self._changed:
            first = self._events[0].seq if self._events else self._next_seq
            missed = seq < first or seq > self._next_seq  # past the end: numbered by another engine
            if missed:
                return list(self._events), True
            return list(itertools.islice(self._events, seq - first, None)), False  # numbered without gaps

    def wait(self, seq: int, timeout_s: float) -> None:
        """Until an event numbered seq exists, or timeout_s passed (a long poll)."""
        with self._changed:
            self._changed.wait_for(lambda: self._next_seq > seq, timeout_s)

    def publish(self) -> None:
        """Send the events since the last call to every publisher, as one batch."""
        with self._changed:
            batch, self._unpublished = self._unpublished, []
        if batch:
            for p in self.publishers:
                p.send(batch)

    def close(self) -> None:
        for p in self.publishers:
            p.close()
        self.publishers = []


def group_of(name: bytes) -> int:
    """The cache group a block name belongs to (its last two bytes, kvserve.core.kv_cache_manager)."""
    return int.from_bytes(name[-2:], "little")


def watch_pool(pool: BlockPool, log: KVEventLog, block_size: int) -> list[Callable[[], None]]:
    """Log the pool's registrations and evictions as events of medium "GPU"; returns the
    functions that stop it."""
    def stored(block: Block) -> None:
        assert block.block_hash is not None and block.token_ids is not None
        log.add("BlockStored", block_hashes=(block.block_hash,), parent_block_hash=block.parent_hash,
                token_ids=block.token_ids, block_size=block_size, medium="GPU", group=group_of(block.block_hash))

    def removed(block: Block) -> None:
        assert block.block_hash is not None
        log.add("BlockRemoved", block_hashes=(block.block_hash,), medium="GPU", group=group_of(block.block_hash))

    return [pool.on_cache.add(stored), pool.on_drop.add(removed),
            pool.on_reset.add(lambda: log.add("AllBlocksCleared"))]


class ZmqPublisher:
    """A ZMQ PUB socket sending each batch as (topic, seq, msgpack payload)."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        try:
            import msgpack
            import zmq
        except ImportError as e:
            raise ValueError(f"--kv-events needs pyzmq and msgpack (pip install 'kvserve[events]'): {e}") from e
        self._pack = msgpack.packb
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PUB)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"--kv-events cannot bind {endpoint!r}: {e}") from e
        self.topic = topic.encode()
        self._seq = 0

    def send(self, events: Sequence[KVEvent]) -> None:
        payload = self._pack([time.time(), [e.to_wire() for e in events]], use_bin_type=True)
        self._socket.send_multipart((self.topic, self._seq.to_bytes(8, "big"), payload))
        self._seq += 1

    def close(self) -> None:
        self._socket.close(linger=0)
        self._ctx.term()
