"""The paged cache's two promises, measured.

1. Memory: a mixed workload (64 requests, prompts 16-1024 tokens, outputs 16-256) runs through
   the real scheduler and KV cache manager with the paged and the contiguous layout in one run,
   with the same byte budget and SmolLM2's fp32 KV size. At every step: bytes reserved vs bytes
   holding real tokens (waste %), and how many sequences run at once. The model does not change
   what is allocated, so this part drives the scheduler with a stand-in sampler and runs in
   seconds.
2. Prefix caching: 32 requests sharing a 1,024-token system prompt on SmolLM2, prefix caching on
   vs off: mean time to first token and prompt tokens computed, with the ratios.

    .venv/bin/python benchmarks/paged_cache.py [--skip-prefix] [--plot paged_cache.png]

Writes benchmarks/results/paged_cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from kvserve.config import SchedulerConfig
from kvserve.core.block_math import blocks_in_budget
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.outputs import ModelRunnerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.kv.formats import kv_format
from kvserve.models.registry import KNOWN_CONFIGS
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams


def memory_run(layout: str, budget: int, max_model_len: int, seed: int) -> dict:
    cfg = KNOWN_CONFIGS["smollm2-135m"]
    per_token = int(kv_format("float32").bytes_per_token(cfg))
    block_size = 16 if layout == "paged" else max_model_len
    num_blocks = blocks_in_budget(budget, block_size * per_token)
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096), kv, max_model_len)
    rng = random.Random(seed)
    for i in range(64):
        prompt = [rng.randrange(100, 49152) for _ in range(rng.randint(16, 1024))]
        sched.add_request(Request(str(i), prompt, SamplingParams(max_tokens=rng.randint(16, 256), ignore_eos=True)))
    reserved, used, running = [], [], []
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, ModelRunnerOutput({s.request_id: [7] for s in out.scheduled if s.num_samples}))
        stats = sched.stats()
        reserved.append(stats.num_reserved_slots * per_token)
        used.append(stats.num_used_slots * per_token)
        running.append(stats.num_running)
        steps += 1
    total_reserved, total_used = sum(reserved), sum(used)
    return {"layout": layout, "block_size": block_size, "num_blocks": num_blocks, "budget_bytes": budget,
            "steps": steps, "mean_reserved_bytes": total_reserved / steps, "mean_used_bytes": total_used / steps,
            "waste_pct": 100 * (total_reserved - total_used) / total_reserved,
            "max_concurrent_seqs": max(running), "mean_concurrent_seqs": statistics.fmean(running),
            "preemptions": sched.num_preemptions, "series": {"reserved": reserved, "used": used, "running": running}}


def prefix_run(loaded, caching: bool) -> dict:
    from kvserve.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_options("bench", loaded=loaded, enable_prefix_caching=caching, num_blocks=2400,
                                    max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=2048)
    tok = loaded.tokenizer
    system = tok.encode("You are a meticulous assistant who answers questions about caches. " * 120)[:1024]
    assert len(system) == 1024, len(system)
    questions = [f" Question {i}: how many blocks does a {16 * (i + 1)}-token prompt need?" for i in range(32)]
    start = time.monotonic()
    for i, q in enumerate(questions):
        engine.add_request(str(i), system + tok.encode(q), SamplingParams(temperature=0, max_tokens=4),
                           arrival_time=start)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    elapsed = time.monotonic() - start
    ttfts = [o.metrics.ttft for o in outs.values()]
    return {"prefix_caching": caching, "elapsed_s": elapsed, "mean_ttft_s": statistics.fmean(ttfts),
            "median_ttft_s": statistics.median(ttfts), "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs.values()),
            "prompt_tokens_computed": engine.num_prompt_tokens_computed,
            "cached_tokens": sum(o.num_cached_tokens for o in outs.values()),
            "prefix_hit_rate": engine.stats().scheduler.prefix_hit_rate,
            "texts": [outs[str(i)].outputs[0].text for i in range(32)]}


def main() -> None:
    ap = argparse.ArgumentParser(description="paged vs contiguous memory; prefix caching on vs off")
    ap.add_argument("--budget-mib", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="draw memory per step for each layout")
    a = ap.parse_args()
    from kvserve.bench.plot import check_plot_path
    check_plot_path(a.plot)
    budget = a.budget_mib << 20
    result: dict = {"memory": []}
    print(f"mixed workload: 64 requests, prompts 16-1024, outputs 16-256, SmolLM2 fp32 KV, budget {a.budget_mib} MiB")
    print(f"{'layout':28} {'waste %':>8} {'reserved MiB':>13} {'used MiB':>9} {'max seqs':>9} {'mean seqs':>10} {'steps':>6}")
    for layout, max_len in (("paged", 8192), ("contiguous", 1280), ("contiguous", 8192)):
        r = memory_run(layout, budget, max_len, a.seed)
        r["max_model_len"] = max_len
        result["memory"].append(r)
        name = f"{layout} (slab {max_len})" if layout == "contiguous" else "paged (block 16)"
        print(f"{name:28} {r['waste_pct']:8.2f} {r['mean_reserved_bytes'] / 2**20:13.1f} "
              f"{r['mean_used_bytes'] / 2**20:9.1f} {r['max_concurrent_seqs']:9d} {r['mean_concurrent_seqs']:10.1f} "
              f"{r['steps']:6d}", flush=True)
    if a.plot:
        from kvserve.bench.plot import memory_figure
        names = ["paged (block 16)", "contiguous (slab 1280)", "contiguous (slab 8192)"]
        memory_figure(a.plot, f"64 mixed requests, SmolLM2 fp32 KV, {a.budget_mib} MiB budget",
                      [{"name": n, "waste_pct": r["waste_pct"], **r["series"]} for n, r in zip(names, result["memory"])])
        print(f"figure: {a.plot}")
    for r in result["memory"]:
        r.pop("series")
    if not a.skip_prefix:
        from kvserve.models.registry import load_weights
        loaded = load_weights("SmolLM2-135M-Instruct")
        on, off = prefix_run(loaded, True), prefix_run(loaded, False)
        assert on["texts"] == off["texts"], "prefix caching changed an output"
        for r in (on, off):
            r.pop("texts")
        result["prefix"] = {"on": on, "off": off,
                            "ttft_ratio_off_over_on": off["mean_ttft_s"] / on["mean_ttft_s"],
                            "computed_ratio_off_over_on": off["prompt_tokens_computed"] / on["prompt_tokens_computed"]}
        print("\n32 requests sharing a 1,024-token system prompt (SmolLM2 fp32), outputs identical on and off:")
        for r in (on, off):
            print(f"  prefix caching {'on ' if r['prefix_caching'] else 'off'}: mean TTFT {r['mean_ttft_s']:.2f} s, "
                  f"median {r['median_ttft_s']:.2f} s, prompt tokens computed {r['prompt_tokens_computed']:,} "
                  f"of {r['prompt_tokens']:,}, prefix hit rate {100 * r['prefix_hit_rate']:.1f}%, total {r['elapsed_s']:.1f} s")
        p = result["prefix"]
        print(f"  off/on: TTFT {p['ttft_ratio_off_over_on']:.1f}x, prompt tokens computed "
              f"{p['computed_ratio_off_over_on']:.1f}x")
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/paged_cache.json", "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
