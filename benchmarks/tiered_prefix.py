"""Tiers below the pool, measured: many users sharing a few long system prompts with a pool too
small for all of them (SmolLM2-135M, fp32 weights and cache, CPU).

Six system prompts of 256 tokens, 18 users one after another in round-robin order (each asks its
own short question after one of the prompts), 4 new tokens each. The pool holds 24 blocks of 16
tokens: a prompt and a half, so under LRU every prompt is evicted before it comes round again.

    none      no tiers: every prompt is computed again
    host      --kv-cache-host-bytes 256 MiB: evicted blocks kept in RAM, loaded back on a hit
    disk      --kv-cache-dir only: evicted blocks kept in files, loaded back on a hit
    restart   a new engine on the directory the disk run left (its pool written down at
              shutdown): the first round too is served from disk

For each: TTFT (arrival to first token, one request at a time, so prefill plus loads) in wall
time and in this process's CPU time (which others' load on a shared machine disturbs far less),
the tokens/s over the run (prompt and generated tokens over the wall time), cached tokens, and
what the tiers did. One torch thread. Wall figures on a shared machine are noisy.

    .venv/bin/python benchmarks/tiered_prefix.py

Writes benchmarks/results/tiered_prefix.json.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch

from kvserve import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.models.registry import load_weights

NUM_PROMPTS, PROMPT_TOKENS, NUM_USERS, NEW_TOKENS = 6, 256, 18, 4
POOL = dict(num_blocks=24, block_size=16, max_model_len=1024, max_num_seqs=1, log_stats_interval_s=None)
TOPICS = ["a library", "a railway", "a hospital", "a school", "a bakery", "an observatory"]


def system_prompts(tok) -> list[list[int]]:
    out = []
    for topic in TOPICS[:NUM_PROMPTS]:
        text = (f"You are the assistant of {topic}. Answer politely, briefly and only about {topic}; "
                f"never invent opening hours, prices or names. ") * 40
        out.append(tok.encode(text)[:PROMPT_TOKENS])
    return out


def requests(tok) -> list[list[int]]:
    prompts = system_prompts(tok)
    return [prompts[u % NUM_PROMPTS] + tok.encode(f" User {u} asks: what should I know today?",
                                                   add_special_tokens=False) for u in range(NUM_USERS)]


def serve(engine: LLMEngine, prompts: list[list[int]]) -> dict:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ttft, ttft_cpu, cached, tokens = [], [], 0, 0
    start = time.perf_counter()
    for p in prompts:
        t0, c0 = time.perf_counter(), time.process_time()
        engine.add_request(None, p, params)
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                    ttft_cpu.append(time.process_time() - c0)
                if out.finished:
                    cached += out.num_cached_tokens
        ttft.append(first)
        tokens += len(p) + NEW_TOKENS
    wall = time.perf_counter() - start
    tiers = [vars(t) for t in engine.tiers.summary()] if engine.tiers is not None else []
    return {"ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft),
            "ttft_first_round_mean_s": statistics.mean(ttft[:NUM_PROMPTS]),
            "ttft_later_rounds_mean_s": statistics.mean(ttft[NUM_PROMPTS:]),
            "ttft_cpu_first_round_mean_s": statistics.mean(ttft_cpu[:NUM_PROMPTS]),
            "ttft_cpu_later_rounds_mean_s": statistics.mean(ttft_cpu[NUM_PROMPTS:]),
            "tokens_per_s": tokens / wall, "wall_s": wall, "cached_tokens": cached,
            "prompt_tokens": sum(map(len, prompts)), "tiers": tiers}


def main() -> None:
    torch.set_num_threads(1)  # a shared machine: one thread's figures vary least with the others' load
    loaded = load_weights("SmolLM2-135M-Instruct")
    prompts = requests(loaded.tokenizer)
    directory = tempfile.mkdtemp(prefix="kvserve-tiers-")
    modes = {"none": {}, "host": {"kv_cache_host_bytes": 256 << 20}, "disk": {"kv_cache_dir": directory}}
    rows = {}
    for name, options in modes.items():
        engine = LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, **POOL, **options)
        rows[name] = serve(engine, prompts)
        engine.close()  # the disk run's pool is written down here, for the restart
        print_row(name, rows[name])
    engine = LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, **POOL, kv_cache_dir=directory)
    rows["restart"] = serve(engine, prompts)
    engine.close()
    print_row("restart", rows["restart"])
    result = {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu", "cpus": os.cpu_count(),
              "num_prompts": NUM_PROMPTS, "prompt_tokens": PROMPT_TOKENS, "users": NUM_USERS,
              "new_tokens": NEW_TOKENS, "pool_blocks": POOL["num_blocks"], "block_size": POOL["block_size"],
              "rows": rows, "torch_threads": 1,
              "note": "one request at a time on a shared 2-core machine: wall figures are noisy, CPU-time TTFT less so"}
    path = os.path.join(os.path.dirname(__file__), "results", "tiered_prefix.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def print_row(name: str, r: dict) -> None:
    hits = ", ".join(f"{t['medium']} {t['num_hit_blocks']} blocks in {1000 * t['load_seconds']:.0f} ms"
                     for t in r["tiers"]) or "-"
    print(f"{name:8s} TTFT mean {r['ttft_mean_s'] * 1000:7.1f} ms (first round {r['ttft_first_round_mean_s'] * 1000:7.1f}, "
          f"later {r['ttft_later_rounds_mean_s'] * 1000:7.1f}; CPU first {r['ttft_cpu_first_round_mean_s'] * 1000:6.1f}, "
          f"later {r['ttft_cpu_later_rounds_mean_s'] * 1000:6.1f})  {r['tokens_per_s']:7.1f} tok/s  "
          f"cached {r['cached_tokens']}/{r['prompt_tokens']}  tier hits: {hits}", flush=True)


if __name__ == "__main__":
    main()
