"""`kvserve bench throughput`: offline throughput on a seeded random workload (random prompt
token ids and output lengths, EOS ignored, as in the vLLM and nano-vllm throughput benchmarks),
and in the same run Hugging Face generate() over the same requests in static batches."""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvserve.bench.args import ThroughputOptions


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(n: int, vocab: int, in_range: tuple[int, int], out_range: tuple[int, int],
                  seed: int) -> Workload:
    rng = random.Random(seed)
    low = min(100, vocab // 4)  # skip the special tokens at the start of most vocabularies
    prompts = [[rng.randrange(low, vocab) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*out_range) for _ in range(n)])


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(elapsed: float, w: Workload, ttfts: list[float], tpots: list[float],
              timeline: list[tuple[float, int]]) -> dict[str, Any]:
    return {
        "elapsed_s": elapsed, "requests_per_s": len(w.prompts) / elapsed,
        "output_tokens_per_s": w.num_output_tokens / elapsed,
        "total_tokens_per_s": (w.num_output_tokens + w.num_prompt_tokens) / elapsed,
        "ttft_ms": _stats(ttfts), "tpot_ms": _stats(tpots),
        "samples": {"ttft_ms": [1000 * x for x in ttfts], "tpot_ms": [1000 * x for x in tpots],
                    "timeline": timeline},
    }


def _stats(xs: list[float]) -> dict[str, float]:
    ms = [1000 * x for x in xs]
    if not ms:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    return {"mean": statistics.fmean(ms), "median": statistics.median(ms), "p99": percentile(ms, 99)}


def run_kvserve(engine: Any, w: Workload) -> dict[str, Any]:
    from kvserve.core.sampling_params import SamplingParams
    start = time.monotonic()
    generated_before = engine.num_generated_tokens
    ids = [engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                              arrival_time=start) for p, n in zip(w.prompts, w.output_lens)]
    done: dict[str, Any] = {}
    timeline: list[tuple[float, int]] = []  # (seconds since start, output tokens so far)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        timeline.append((time.monotonic() - start, engine.num_generated_tokens - generated_before))
    elapsed = time.monotonic() - start
    outs = [done[i] for i in ids]
    assert all(len(o.outputs[0].token_ids) == n for o, n in zip(outs, w.output_lens))
    ttfts = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    tpots = [t for o in outs if (t := o.metrics.tpot(len(o.outputs[0].token_ids))) is not None]
    r = summarize(elapsed, w, ttfts, tpots, timeline)
    r["preemptions"] = engine.stats().scheduler.num_preemptions
    return r


def run_hf(model: Any, w: Workload, batch_size: int, pad_id: int) -> dict[str, Any]:
    """Static batches in arrival order, left-padded; a batch runs until its longest output."""
    import torch
    start = time.monotonic()
    ttfts, tpots = [], []
    timeline: list[tuple[float, int]] = []  # a static batch's tokens all arrive when it ends
    for b in range(0, len(w.prompts), batch_size):
        prompts, lens = w.prompts[b:b + batch_size], w.output_lens[b:b + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.monotonic()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, pad_token_id=pad_id)
        t1 = time.monotonic()
        # generate() returns everything at the end: a static batch's first token arrives then
        ttfts += [t1 - start] * len(prompts)
        tpots += [(t1 - t0) / max(lens)] * len(prompts)
        timeline.append((t1 - start, (timeline[-1][1] if timeline else 0) + sum(lens)))
    return summarize(time.monotonic() - start, w, ttfts, tpots, timeline)


def load_hf_model(model_path: str, dtype: str) -> Any:
    import torch
    import transformers
    from kvserve.models.registry import resolve_path
    path = resolve_path(model_path)
    if path.endswith(".gguf"):
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype)).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()


def run_throughput(model: str, engine_options: dict[str, Any], o: ThroughputOptions) -> int:
    from kvserve.bench.plot import check_plot_path
    from kvserve.engine.llm_engine import LLMEngine
    check_plot_path(o.plot)
    engine = LLMEngine.from_options(model, **engine_options)
    w = make_workload(o.num_prompts, engine.model_config.vocab_size, (o.input_len_min, o.input_len_max),
                      (o.output_len_min, o.output_len_max), o.bench_seed)
    max_num_seqs = engine.config.scheduler.max_num_seqs
    print(f"workload: {o.num_prompts} requests, {w.num_prompt_tokens} prompt tokens, "
          f"{w.num_output_tokens} output tokens (seed {o.bench_seed}); model {model}, {engine.config.dtype}, "
          f"max_num_seqs {max_num_seqs}")
    warm = make_workload(2, engine.model_config.vocab_size, (8, 8), (4, 4), 1)
    run_kvserve(engine, warm)
    ours = run_kvserve(engine, w)
    result: dict[str, Any] = {"workload": {"model": model, **engine_options, **asdict(o)}, "kvserve": ours}
    _print("kvserve", ours)
    if not o.no_hf:
        hf_model = load_hf_model(model, engine.config.dtype)
        batch = o.hf_batch_size or max_num_seqs
        run_hf(hf_model, warm, 2, 0)
        theirs = run_hf(hf_model, w, batch, 0)
        _print(f"HF generate (static batch {batch})", theirs)
        result["hf"] = theirs
        result["ratio_output_tokens_per_s"] = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        print(f"kvserve / HF output tokens/s: {result['ratio_output_tokens_per_s']:.2f}x")
    if o.output_json:
        with open(o.output_json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    if o.plot:
        from kvserve.bench.plot import latency_figure
        runs = {"kvserve": ours, **({"HF generate": result["hf"]} if "hf" in result else {})}
        latency_figure(o.plot, f"bench throughput: {o.num_prompts} requests, {model}",
                       {k: {"ttft": r["samples"]["ttft_ms"], "tpot": r["samples"]["tpot_ms"]} for k, r in runs.items()},
                       {k: r["samples"]["timeline"] for k, r in runs.items()})
        print(f"figure: {o.plot}")
    return 0


def _print(name: str, r: dict[str, Any]) -> None:
    t, p = r["ttft_ms"], r["tpot_ms"]
    print(f"{name}: {r['elapsed_s']:.1f} s | {r['requests_per_s']:.2f} req/s | "
          f"{r['output_tokens_per_s']:.1f} output tok/s | {r['total_tokens_per_s']:.1f} total tok/s\n"
          f"  TTFT ms mean {t['mean']:.0f} median {t['median']:.0f} p99 {t['p99']:.0f} | "
          f"TPOT ms mean {p['mean']:.1f} median {p['median']:.1f} p99 {p['p99']:.1f}"
          + (f" | preemptions {r['preemptions']}" if "preemptions" in r else ""), flush=True)


__all__ = ["run_throughput", "make_workload", "Workload"]
