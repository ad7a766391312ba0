"""The cache under memory pressure, on a random Llama (8 layers, hidden 256, 8 query and 4 KV
heads of 32, vocabulary 1,024; fp32 on the CPU), blocks of 16 tokens.

1. Eviction policies. A 256-token system prompt shared by 12 users (each adding 32 tokens of
   their own, 8 tokens out), with a background job of 320 unrelated tokens after every third
   user (scheduling priority 5: less important than the users' 0), two requests at a time, in a
   cache of 36 blocks: too small to keep the system prompt through a background job unless the
   policy chooses well. Per policy (and LRU with the system prompt given retention priority 90):
   the users' prefix hit rate (prompt tokens served from the cache / prompt tokens) and their
   mean time to first token.
2. Preemption. 6 requests of 48 prompt tokens and 64 out, all at once, in 24 blocks (they are
   admitted together and outgrow the cache as they decode): each
   fixed mode against auto (swap or recompute per victim by the measured costs): wall time,
   output tok/s, preemptions and the choices auto made with the speeds it measured.

    .venv/bin/python benchmarks/memory_pressure.py [--only eviction | preemption]

Writes benchmarks/results/memory_pressure.json. Figures from a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvserve.config import EVICTION_POLICIES, ModelConfig
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loaders.base import LoadedModel

RESULTS = Path(__file__).parent / "results" / "memory_pressure.json"
VOCAB, SYSTEM_LEN, USER_LEN, NUM_USERS, SCAN_LEN = 1024, 256, 32, 12, 320


def random_llama() -> LoadedModel:
    config = ModelConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         name="random-llama-8x256")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    sd = {k: (torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=g) * 0.05)
          for k, s in shapes.items()}
    return LoadedModel(config, sd, None, config.name)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def shared_prompt_workload() -> list[tuple[list[int], int, bool]]:
    """(prompt, scheduling priority, is a user) in arrival order."""
    rng = random.Random(0)
    system = tokens(rng, SYSTEM_LEN)
    work: list[tuple[list[int], int, bool]] = []
    for i in range(NUM_USERS):
        work.append((system + tokens(rng, USER_LEN), 0, True))
        if i % 3 == 2:
            work.append((tokens(rng, SCAN_LEN), 5, False))
    return work


def run_policy(loaded: LoadedModel, policy: str, retain: bool) -> dict[str, Any]:
    engine = LLMEngine.from_options("preloaded", loaded=loaded, num_blocks=36, block_size=16, max_num_seqs=2,
                                    eviction_policy=policy, preemption_mode="recompute")
    keep = [{"start": 0, "end": SYSTEM_LEN, "priority": 90}] if retain else []
    work = shared_prompt_workload()
    hits = prompt = 0
    ttfts = []
    for start in range(0, len(work), 2):  # two at a time: each pair arrives when the last has left
        ids = {}
        for prompt_ids, priority, is_user in work[start:start + 2]:
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                    kv_retention=keep if is_user else [])
            ids[engine.add_request(None, prompt_ids, params, priority=priority)] = is_user
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished and ids[out.request_id]:
                    hits += out.num_cached_tokens
                    prompt += len(out.prompt_token_ids)
                    ttfts.append(out.metrics.ttft)
    return {"policy": policy + (" + retention 90 on the system prompt" if retain else ""),
            "user_prefix_hit_rate": round(hits / prompt, 4), "user_ttft_ms_mean": round(1e3 * statistics.mean(ttfts), 2),
            "user_ttft_ms_median": round(1e3 * statistics.median(ttfts), 2), "evictions": engine.kv.pool.num_evictions}


def run_preemption(loaded: LoadedModel, mode: str) -> dict[str, Any]:
    engine = LLMEngine.from_options("preloaded", loaded=loaded, num_blocks=24, block_size=16, max_num_seqs=6,
                                    max_num_batched_tokens=512, preemption_mode=mode, swap_space=1 << 26)
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for _ in range(6):
        engine.add_request(None, tokens(rng, 48), params)
    t0 = time.perf_counter()
    num_out = 0
    while engine.has_unfinished():
        num_out += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    wall = time.perf_counter() - t0
    stats = engine.stats()
    return {"mode": mode, "wall_s": round(wall, 3), "output_tok_s": round(num_out / wall, 1),
            "preemptions": stats.scheduler.num_preemptions, "swaps_out": stats.num_swaps_out,
            "choices": {f"{m}/{why}": n for m, why, n in stats.preemption_choices},
            "measured_prefill_tok_s": round(stats.prefill_tokens_per_s, 1),
            "measured_copy_gb_s": round(stats.copy_bytes_per_s / 1e9, 3)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=("eviction", "preemption"), help="run one part, keeping the other's stored figures")
    only = p.parse_args().only
    torch.set_num_threads(2)
    loaded = random_llama()
    stored = json.loads(RESULTS.read_text()) if RESULTS.exists() and only else {}
    results = {"model": "random-llama-8x256 fp32, CPU", "torch_threads": 2, **stored}
    if only != "preemption":
        results["eviction"] = eviction_part(loaded)
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    if only != "eviction":
        results["preemption"] = preemption_part(loaded)
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


def eviction_part(loaded: LoadedModel) -> list[dict[str, Any]]:
    policies = []
    for policy, retain in [(p, False) for p in EVICTION_POLICIES] + [("lru", True)]:
        row = run_policy(loaded, policy, retain)
        policies.append(row)
        print(f"{row['policy']:45s} hit rate {row['user_prefix_hit_rate']:.3f}  TTFT mean "
              f"{row['user_ttft_ms_mean']:7.2f} ms  median {row['user_ttft_ms_median']:7.2f} ms  "
              f"evictions {row['evictions']}", flush=True)
    return policies


def preemption_part(loaded: LoadedModel) -> list[dict[str, Any]]:
    modes = []
    for mode in ("recompute", "swap", "auto"):
        row = run_preemption(loaded, mode)
        modes.append(row)
        print(f"{row['mode']:10s} {row['wall_s']:7.2f} s  {row['output_tok_s']:7.1f} tok/s  preemptions "
              f"{row['preemptions']}  swaps {row['swaps_out']}  {row['choices']}  prefill "
              f"{row['measured_prefill_tok_s']} tok/s, copy {row['measured_copy_gb_s']} GB/s", flush=True)
    return modes


if __name__ == "__main__":
    main()
