"""What the router knows of each replica's cache: the block names it holds, by medium, kept equal
to the replica's pool and tiers by its KV events (GET /v1/kv/events, kvserve/server/kv_events_api.py).

A request's blocks are named as the engine names them (kvserve.core.block_hash: the chain of
SHA-256 hashes from the root of the model's namespace and the request's cache_salt, with the
cache group), so the router, holding the model's tokenizer, finds how long a prefix of the
request each replica holds without asking it:

    tokens  --hash_full_blocks-->  [h0, h1, h2, ...]  --block_name(h, 0)-->  names
    replica view: {name: {"GPU", "CPU", "DISK"}}   overlap = the leading names it holds, each
    weighed by where (a block in the pool is free; one in a tier costs a load first)

A request routed to a replica counts as held there (`predict`) until its own events arrive or
a few seconds pass, so requests of one prefix arriving together meet on one replica.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from kvserve.core.block_hash import hash_full_blocks, root_hash
from kvserve.core.block_math import num_full_blocks
from kvserve.core.kv_cache_manager import block_name

MEDIUM_WEIGHTS = {"GPU": 1.0, "CPU": 0.75, "DISK": 0.5}  # a block's worth by where it is held
PREDICTED_S = 5.0  # how long a routed request's blocks count as held before its events confirm them


class ReplicaBlocks:
    """One replica's blocks by medium, as its events say, and the cursor to follow them from."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.held: dict[bytes, set[str]] = {}
        self.predicted: dict[bytes, float] = {}  # name -> until when it counts as held
        self.epoch: Optional[str] = None
        self.cursor = 0  # the next event number to ask for
        self.block_size: Optional[int] = None
        self.namespace: Optional[tuple[Any, ...]] = None

    def reset(self) -> None:
        """Forget everything (the replica is gone, or restarted)."""
        self.held, self.predicted, self.epoch, self.cursor = {}, {}, None, 0

    def apply(self, answer: dict[str, Any]) -> None:
        """One answer of GET /v1/kv/events?since=cursor."""
        self.block_size, self.namespace = answer["block_size"], tuple(answer["namespace"])
        if answer["epoch"] != self.epoch:  # a new engine: what was known of the old one is gone
            self.reset()
            self.epoch = answer["epoch"]
            events = answer["events"]
            if answer["snapshot"] is None and not (events and events[0]["seq"] == 0):
                return  # the answer was for another engine's cursor: ask again from 0
        if answer["snapshot"] is not None:
            self.held = {}
            for medium, names in answer["snapshot"].items():
                for name in names:
                    self.held.setdefault(bytes.fromhex(name), set()).add(medium)
        for event in answer["events"]:
            self.apply_event(event)
        self.cursor = answer["next"]

    def apply_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "AllBlocksCleared":
            self.held = {}
            return
        for name in map(bytes.fromhex, event["block_hashes"]):
            if kind == "BlockStored":
                self.held.setdefault(name, set()).add(event["medium"])
                self.predicted.pop(name, None)
            elif name in self.held:
                self.held[name].discard(event["medium"])
                if not self.held[name]:
                    del self.held[name]

    def predict(self, names: Sequence[bytes]) -> None:
        until = self.clock() + PREDICTED_S
        for name in names:
            if name not in self.held:
                self.predicted[name] = until

    def overlap(self, names: Sequence[bytes]) -> float:
        """The leading names this replica holds (or was just sent), each weighed by its best medium."""
        now, total = self.clock(), 0.0
        for name in names:
            media = self.held.get(name)
            if media:
                total += max(MEDIUM_WEIGHTS.get(m, 0.0) for m in media)
            elif self.predicted.get(name, 0.0) > now:
                total += MEDIUM_WEIGHTS["GPU"]
            else:
                break
        return total

    def names_in(self, medium: str) -> set[bytes]:
        return {name for name, media in self.held.items() if medium in media}

    def counts(self) -> dict[str, int]:
        return {m: sum(m in media for media in self.held.values()) for m in MEDIUM_WEIGHTS}

    def request_names(self, token_ids: Sequence[int], cache_salt: Optional[str]) -> list[bytes]:
        """The names of the request's blocks a prefix hit may cover (the last token is always
        computed), as the replica's engine names them; none before its first answer."""
        if self.block_size is None or self.namespace is None:
            return []
        limit = num_full_blocks(len(token_ids) - 1, self.block_size) if token_ids else 0
        root = root_hash(*self.namespace, cache_salt)
        return [block_name(h, 0) for h in hash_full_blocks(root, token_ids[:limit * self.block_size], self.block_size)]
