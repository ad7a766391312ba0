"""The cache's state as data: every block, every request's block tables, the pool's totals.

What `GET /v1/kv/state` returns, the dashboard draws and a trace records step by step. Taken
between two steps on the engine's thread, so tables, reference counts and totals are one
instant's, and the totals are the very figures /metrics reports for that instant.

    {"step": engine steps so far, "time": unix seconds,
     "block_size", "block_bytes", "kv_cache_dtype", "null_block": the null block's id,
     "groups": [{"kind": "full" | "sliding_window" | "sink_window", "window", "sinks"}],
     "blocks": {"status": one character a block, "f" free, "c" cached and evictable (ref 0, hash
                kept), "u" in use (ref > 0);
                "ref_count": [int] a block, "hashed": one "0"/"1" a block (its hash registered),
                "retention": [int] a block, its retention priority now (1-100, 35 by default; higher
                is evicted later)},
     "eviction_policy": "lru" | "fifo" | "priority" | "cost", "preemption_mode": "auto" | ...,
     "requests": [{"id", "status": "running" | "swapped" | "waiting" | "preempted", "priority",
                   "prompt_tokens", "output_tokens", "cached_tokens" (prefix hits at admission),
                   "kv_retention": [{"start", "end", "priority", "duration_s"}] as the request gave them,
                   "computed_tokens", "blocks_held", "bytes_held",
                   "tables": [[block ids] per group] (GPU/host pool; swapped: the CPU pool's ids)}],
     "totals": {"num_blocks", "free", "cached", "used", "usage", "prefix_hit_rate",
                "num_running", "num_waiting", "preemptions", "swaps_out", "swaps_in",
                "evictions", "cpu_blocks", "cpu_used", "generated_tokens", "prompt_tokens_computed",
                "preemption_choices": [{"mode": "swap" | "recompute", "reason", "count"}]},
     "tiers": [{"medium": "CPU" | "DISK", "num_blocks", "num_bytes", "max_bytes", "num_hit_blocks",
                "num_stored_blocks", "load_seconds"}] the tiers below the pool (none: [])}
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from kvserve.core.request import Request, RequestStatus


def kv_state(engine: Any) -> dict[str, Any]:
    kv, sched, plan = engine.kv, engine.scheduler, engine.plan
    pool = kv.pool
    status, refs, hashed, retention = [], [], [], []
    now = pool.clock()
    for b in pool.blocks:
        refs.append(b.ref_cnt)
        retention.append(b.effective_retention(now))
        hashed.append("1" if b.block_hash is not None else "0")
        status.append("u" if b.ref_cnt else "c" if b.block_hash is not None else "f")
    requests = [_request(engine, r) for r in list(sched.running) + list(sched.waiting)]
    cpu = kv.cpu_pool
    totals = {"num_blocks": pool.num_blocks, "free": status.count("f"), "cached": status.count("c"),
              "used": status.count("u"), "usage": kv.usage, "prefix_hit_rate": kv.prefix_hit_rate,
              "num_running": len(sched.running), "num_waiting": len(sched.waiting),
              "preemptions": sched.num_preemptions, "swaps_out": kv.num_swaps_out, "swaps_in": kv.num_swaps_in,
              "evictions": pool.num_evictions, "cpu_blocks": cpu.num_blocks if cpu else 0,
              "cpu_used": cpu.num_used_blocks if cpu else 0, "generated_tokens": engine.num_generated_tokens,
              "prompt_tokens_computed": engine.num_prompt_tokens_computed,
              "preemption_choices": [{"mode": mode, "reason": why, "count": n}
                                     for (mode, why), n in sorted(sched.preemption_choices.items())]}
    return {"step": engine.num_steps, "time": time.time(), "block_size": plan.block_size,
            "block_bytes": plan.block_bytes, "kv_cache_dtype": plan.kv_format.name, "null_block": kv.null_block,
            "groups": [{"kind": g.spec.kind, "window": g.spec.window, "sinks": g.spec.sinks} for g in kv.groups],
            "blocks": {"status": "".join(status), "ref_count": refs, "hashed": "".join(hashed), "retention": retention},
            "eviction_policy": pool.eviction_policy, "preemption_mode": sched.preemption.name,
            "requests": requests, "totals": totals,
            "tiers": [asdict(t) for t in engine.tiers.summary()] if engine.tiers is not None else []}


def _request(engine: Any, r: Request) -> dict[str, Any]:
    kv = engine.kv
    rid = r.request_id
    if r.status == RequestStatus.SWAPPED:
        tables = [list(t) for t in kv.swapped_blocks.get(rid, [])]
        held = sum(map(len, tables))
    else:
        tables = [list(g.table(rid)) for g in kv.groups]
        held = kv.num_held_blocks(rid)
    return {"id": rid, "status": r.status.value, "priority": r.priority, "prompt_tokens": r.num_prompt_tokens,
            "output_tokens": r.num_output_tokens, "cached_tokens": r.num_cached_tokens or 0,
            "kv_retention": [asdict(x) for x in r.sampling_params.kv_retention],
            "computed_tokens": r.num_computed_tokens, "blocks_held": held,
            "bytes_held": held * engine.plan.block_bytes, "tables": tables}
