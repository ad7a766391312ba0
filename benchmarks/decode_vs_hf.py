"""Batch-1 prefill and decode speed on SmolLM2: kvserve with the cache, kvserve recomputing
without it, and Hugging Face generate() on the same weights, in one run, with ratios.

    .venv/bin/python benchmarks/decode_vs_hf.py [--dtypes float32 bfloat16] [--lengths 32 128 256]

For each context length L: prefill tokens/s of an L-token prompt, then the median time of each
of the next --new-tokens decode steps (the context grows from L). Medians of --repeats runs,
interleaved (kvserve, no cache, HF, kvserve, ...).
Writes benchmarks/results/decode_vs_hf.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvserve.engine.llm_engine import LLMEngine
from kvserve.models.registry import default_model_path, load_weights
from kvserve.core.sampling_params import SamplingParams


def ours(loaded, dtype: str, prompt: list[int], new_tokens: int, use_cache: bool) -> tuple[float, float]:
    """(prefill seconds, median seconds per decode step)."""
    engine = LLMEngine.from_options("bench", loaded=loaded, dtype=dtype, use_cache=use_cache,
                                    num_blocks=64, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)
    engine.add_request("warmup", prompt[:8], SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    engine.add_request("r", prompt, params)
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times[0], statistics.median(times[1:])


def hf(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])

    def gen(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    gen(2)  # warm-up
    prefill = gen(1)
    total = gen(new_tokens + 1)
    return prefill, (total - prefill) / new_tokens


def medians_interleaved(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """Each repeat runs every contender once, in turn, so a slow spell on a shared machine
    touches them alike; then the median per contender of (prefill s, s per decode step)."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            runs[name].append(fn())
    return {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
            for name, rs in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[32, 128, 256])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    loaded = load_weights("SmolLM2-135M-Instruct")
    text = "The key and value of every processed token are kept per layer and reused. " * 40
    tokens = loaded.tokenizer.encode(text)
    rows = []
    for dtype in a.dtypes:
        hf_model = None
        if not a.no_hf:
            import transformers
            path = default_model_path()
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype)).eval()
        for L in a.lengths:
            prompt = tokens[:L]
            row = {"dtype": dtype, "length": L}
            fns = {"cache": lambda: ours(loaded, dtype, prompt, a.new_tokens, True),
                   "no_cache": lambda: ours(loaded, dtype, prompt, a.new_tokens, False)}
            if hf_model is not None:
                fns["hf"] = lambda: hf(hf_model, prompt, a.new_tokens)
            for name, (prefill_s, step_s) in medians_interleaved(fns, a.repeats).items():
                row[name] = {"prefill_tok_s": L / prefill_s, "decode_tok_s": 1 / step_s,
                             "ms_per_token": 1000 * step_s}
            if "hf" in row:
                row["decode_ratio_vs_hf"] = row["cache"]["decode_tok_s"] / row["hf"]["decode_tok_s"]
                row["prefill_ratio_vs_hf"] = row["cache"]["prefill_tok_s"] / row["hf"]["prefill_tok_s"]
            row["cache_speedup_vs_no_cache"] = row["no_cache"]["ms_per_token"] / row["cache"]["ms_per_token"]
            rows.append(row)
            print_row(row)
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/decode_vs_hf.json", "w") as f:
        json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


def print_row(r: dict) -> None:
    def cell(k: str) -> str:
        if k not in r:
            return "      -      "
        return f"{r[k]['prefill_tok_s']:7.0f} {r[k]['decode_tok_s']:5.1f} {r[k]['ms_per_token']:6.1f}"
    if r["length"] == 32 or not hasattr(print_row, "header"):
        print_row.header = True  # type: ignore[attr-defined]
        print(f"{'dtype':9} {'len':>4} | {'kvserve cache: pf/s dec/s ms':29} | {'no cache':21} | "
              f"{'HF generate':21} | dec x HF | pf x HF | cache speedup")
    print(f"{r['dtype']:9} {r['length']:4} | {cell('cache'):29} | {cell('no_cache'):21} | {cell('hf'):21} | "
          f"{r.get('decode_ratio_vs_hf', float('nan')):8.2f} | {r.get('prefill_ratio_vs_hf', float('nan')):7.2f} | "
          f"{r['cache_speedup_vs_no_cache']:6.1f}x", flush=True)


if __name__ == "__main__":
    main()
