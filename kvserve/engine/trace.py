"""A step-by-step record of what the engine did to its cache, for `kvserve visualize`.

One JSON object a line: a header (the model's shape and the pool's), then one object a step:

    {"kind": "step", "step": n,
     "scheduled": [{"id", "start": first position computed, "num_tokens", "context_len",
                    "phase": "prefill" | "decode", "pieces": the tokens whose K/V the step wrote,
                    "cached_pieces": the tokens before start found in the prefix cache, where the
                    trace has not seen them yet (positions 0 ..)}],
     "copy_on_write": [[shared block, its copy]], "swap_out": [[block, cpu block]],
     "swap_in": [[cpu block, block]], "preempted": requests preempted this step,
     "finished": [ids], "state": the cache after the step (kvserve/engine/kv_state.py)}

Recorded with `--trace FILE` on any command that runs the engine (`kvserve generate`, `serve`),
or by `kvserve visualize`, which records a small scenario and draws it.
"""

from __future__ import annotations

import json
from typing import IO, Any, Optional

from kvserve.engine.kv_state import kv_state


class StepTrace:
    def __init__(self, engine: Any, path: Optional[str] = None) -> None:
        self.records: list[dict[str, Any]] = []
        self._file: Optional[IO[str]] = open(path, "w", encoding="utf-8") if path else None
        c = engine.model_config
        self._emit({"kind": "header", "model": engine.model_id, "num_layers": c.num_hidden_layers,
                    "num_heads": c.num_attention_heads, "num_kv_heads": c.num_key_value_heads,
                    "head_dim": c.head_dim, "block_size": engine.plan.block_size,
                    "num_blocks": engine.plan.num_blocks, "block_bytes": engine.plan.block_bytes,
                    "kv_cache_dtype": engine.plan.kv_format.name, "max_model_len": engine.max_model_len})
        self._piece = _piece_fn(engine.tokenizer)
        self._known: dict[str, int] = {}  # per request: positions the trace has shown it holding

    def record(self, engine: Any, sched: Any) -> None:
        scheduled = []
        for s in sched.scheduled:
            entry = {"id": s.request_id, "start": s.start_position, "num_tokens": s.num_tokens,
                     "context_len": s.context_len,
                     "phase": "prefill" if s.start_position < len(s.prompt_token_ids) else "decode",
                     "pieces": [self._piece(t) for t in s.input_token_ids]}
            if self._known.get(s.request_id, 0) < s.start_position:  # a prefix-cache hit
                tokens = (s.prompt_token_ids + s.output_token_ids)[:s.start_position]
                entry["cached_pieces"] = [self._piece(t) for t in tokens]
            self._known[s.request_id] = s.context_len
            scheduled.append(entry)
        for rid in sched.finished_request_ids:
            self._known.pop(rid, None)
        c = sched.copies
        state = kv_state(engine)
        state.pop("time")
        self._emit({"kind": "step", "step": engine.num_steps, "scheduled": scheduled,
                    "copy_on_write": [list(p) for p in c.copy_on_write], "swap_out": [list(p) for p in c.swap_out],
                    "swap_in": [list(p) for p in c.swap_in], "preempted": sched.num_preempted,
                    "finished": list(sched.finished_request_ids), "state": state})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _emit(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()


def load_trace(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records or records[0].get("kind") != "header":
        raise ValueError(f"{path}: not a kvserve trace (no header line)")
    return records


def _piece_fn(tokenizer: Any) -> Any:
    if tokenizer is None:
        return str
    cache: dict[int, str] = {}

    def piece(t: int) -> str:
        if t not in cache:
            cache[t] = tokenizer.decode([t], skip_special_tokens=False)
        return cache[t]
    return piece
