"""GET /v1/kv/events: the engine's KV events for simple consumers (the router among them).

    GET /v1/kv/events?since=N&timeout_s=T
    -> {"epoch": the engine's event log id (another one: the engine restarted),
        "next": the number to ask from next time,
        "events": [{"seq", "type", "block_hashes" (hex), "parent_block_hash", "token_ids",
                    "block_size", "lora_id", "medium", "group", "ts"}],
        "snapshot": null, or where the consumer is too far behind (or new to this epoch and the
                    backlog no longer starts at 0): {"GPU": [hex], "CPU": [hex], "DISK": [hex]},
                    every block held now, by medium; "events" then holds what came after it,
        "block_size", "namespace": what the engine hashes blocks with (kvserve.core.block_hash:
                    root_hash(*namespace, cache_salt))}

A long poll: with timeout_s > 0 the answer waits (at most 30 s) until there is an event
numbered N or later.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvserve.engine.llm_engine import LLMEngine

MAX_WAIT_S = 30.0


def kv_snapshot(engine: LLMEngine) -> tuple[int, dict[str, list[str]]]:
    """On the engine thread: the event number the snapshot stands at and every block held, by
    medium (events numbered from it on may repeat what it shows: applying them again is harmless)."""
    seq = engine.kv_events.next_seq
    held = {"GPU": [b.block_hash.hex() for b in engine.kv.pool.blocks if b.block_hash is not None]}
    if engine.tiers is not None:
        for tier in engine.tiers.tiers:
            held[tier.medium] = [name.hex() for name in tier.names()]
    return seq, held


def events_answer(engine: LLMEngine, since: int, snapshot: bool = False) -> dict[str, Any]:
    """The answer to GET /v1/kv/events?since=N (with snapshot, or where N is out of the backlog:
    the snapshot and what came after it; that part must run on the engine thread)."""
    log = engine.kv_events
    events, missed = log.since(since)
    start, held = since, None
    if missed or snapshot:
        start, held = kv_snapshot(engine)
        events, _ = log.since(start)
    return {"epoch": log.epoch, "next": events[-1].seq + 1 if events else start,
            "events": [e.to_json() for e in events], "snapshot": held,
            "block_size": engine.plan.block_size, "namespace": list(engine.kv.namespace)}


def install_kv_event_routes(app: Any, aengine: Any, engine: LLMEngine) -> None:
    from kvserve.server.errors import APIError
    log = engine.kv_events

    @app.get("/v1/kv/events")
    async def kv_events(since: int = 0, timeout_s: float = 0.0) -> dict[str, Any]:
        """The KV events numbered `since` and on (see kvserve/server/kv_events_api.py)."""
        if since < 0:
            raise APIError(400, f"since must be >= 0, got {since}", "since")
        if not 0 <= timeout_s <= MAX_WAIT_S:
            raise APIError(400, f"timeout_s must be in [0, {MAX_WAIT_S:g}], got {timeout_s}", "timeout_s")
        if timeout_s > 0 and log.next_seq <= since:
            await asyncio.to_thread(log.wait, since, timeout_s)
        if log.since(since)[1]:  # out of the backlog: a snapshot, taken between two steps
            return await aengine.call(lambda e: events_answer(e, since, snapshot=True))  # type: ignore[no-any-return]
        return events_answer(engine, since)
