"""Selective layer caching (--cache-layers): the memory it saves and the decode speed it costs,
beside the claim "caching the last 4 layers instead of all 32 reduces memory by 7/8 with minimal
speed loss".

SmolLM2-135M (30 layers, fp32 weights), batch 1: for each context length a prompt of random
tokens is prefilled (untimed), then `--steps` decode steps are timed (median, after one
untimed). A layer without a cache is recomputed over the whole sequence at every step, so the
layers below the last uncached one run as a prefill of the context at every token: the cost
grows with the context. Memory: the cache's bytes per token, and the bytes a 1 GiB budget holds
in sequences of the context. The tokens of every setting are checked equal to the full cache's.

    .venv/bin/python benchmarks/cache_layers.py [--contexts 128 512] [--settings all last:15 last:4 last:1]
                                                [--steps 8] [--threads N] [--model SmolLM2-135M-Instruct]

Writes benchmarks/results/cache_layers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.models.registry import load_weights

RESULTS = os.path.join(os.path.dirname(__file__), "results", "cache_layers.json")
CLAIM = "caching the last 4 layers instead of all 32 reduces memory by 7/8 with minimal speed loss"


def make_engine(loaded, setting: str, context: int, steps: int) -> LLMEngine:
    return LLMEngine.from_options("bench", loaded=loaded, cache_layers=setting, max_model_len=context + steps + 16,
                                  max_num_seqs=1, max_num_batched_tokens=max(context, 256),
                                  num_blocks=(context + steps) // 16 + 4, enable_prefix_caching=False)


def decode_run(loaded, setting: str, context: int, steps: int) -> dict:
    """Prefill `context` random tokens, then time `steps` decode steps: tok/s and the tokens."""
    engine = make_engine(loaded, setting, context, steps)
    prompt = torch.randint(100, loaded.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    engine.add_request("0", prompt.tolist(), SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()  # the prefill
    prefill_s = time.perf_counter() - t0
    times, tokens = [], []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        times.append(time.perf_counter() - t0)
    per_token = engine.plan.block_bytes / engine.plan.block_size
    return {"setting": setting, "context": context, "cached_layers": _cached_layers(engine),
            "kv_bytes_per_token": per_token, "cache_bytes": engine.storage.nbytes,
            "seqs_in_1GiB": int((1 << 30) // (per_token * context)), "prefill_s": prefill_s,
            "decode_tok_s": 1 / statistics.median(times[1:]), "decode_steps_timed": len(times) - 1,
            "tokens": list(tokens)}


def _cached_layers(engine: LLMEngine) -> int:
    selection = engine.cache_layers
    return engine.model_config.num_hidden_layers if selection is None else len(selection.cached)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    p.add_argument("--settings", nargs="+", default=["all", "last:15", "last:4", "last:1"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's; 1 steadies the figures on a machine others share)")
    a = p.parse_args()
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    loaded = load_weights(a.model)
    rows = []
    for context in a.contexts:
        full = decode_run(loaded, "all", context, a.steps)  # what each setting is measured against
        for setting in a.settings:
            row = full if setting == "all" else decode_run(loaded, setting, context, a.steps)
            row = {**row, "memory_vs_all": row["kv_bytes_per_token"] / full["kv_bytes_per_token"],
                   "speed_vs_all": row["decode_tok_s"] / full["decode_tok_s"],
                   "tokens_equal_all": row["tokens"] == full["tokens"]}
            del row["tokens"]
            rows.append(row)
            print(f"context {context:5d}  {setting:8s}  {row['cached_layers']:2d} layers cached  "
                  f"{row['kv_bytes_per_token']:8,.0f} B/token ({row['memory_vs_all']:.3f} of all)  "
                  f"decode {row['decode_tok_s']:7.1f} tok/s ({row['speed_vs_all']:.3f} of all)  "
                  f"tokens equal: {row['tokens_equal_all']}", flush=True)
    result = {"claim": CLAIM, "model": loaded.config.name, "layers": loaded.config.num_hidden_layers,
              "batch": 1, "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "note": "shared 2-core machine under load from other work: speeds are noisy", "rows": rows}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
