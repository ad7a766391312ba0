"""A prompt's chunk attention on CPU: kvserve's kernel (csrc/chunk_attention.cpp, at each level
this CPU runs) against PyTorch's fused attention (SDPA) in bf16 and in fp32, one layer of
SmolLM2-135M (9 heads over 3 K/V heads, head dim 64) and of Gemma-3-270M (4 over 1, 256), a
chunk that starts its sequence, keys and values in bf16 (what a bf16 cache gives back). The
outputs are checked against SDPA in fp32 (1e-4) before timing; the contenders run by turns within
each repeat, medians reported.

With --throughput, the offline throughput workload of benchmarks/peers.py (64 requests, prompts
and outputs of 64-192 tokens, seed 0) through the defaults' engine, the chunks through the kernel
and through SDPA (the engine's backend told to keep no chunk kernel), interleaved: output tok/s
and the seconds of the steps that computed prompt tokens.

    .venv/bin/python benchmarks/chunk_attention.py [--lengths 64 132 512 1024] [--threads 2]
        [--repeats 15] [--throughput [--runs 3]]

Writes benchmarks/results/chunk_attention.json. On a shared machine the timings are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kvserve import kernels

SHAPES = {"smollm2": (9, 3, 64), "gemma3-270m": (4, 1, 256)}  # (heads, K/V heads, head dim)
RESULT = os.path.join(os.path.dirname(__file__), "results", "chunk_attention.json")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """[L, heads, D] as the torch backend attends a chunk: one [1, heads, L, D] batch, causal."""
    batch = (t.to(dtype).transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(*batch, is_causal=True, enable_gqa=q.shape[1] != k.shape[1],
                                         scale=scale)
    return out[0].transpose(0, 1).float()


def contenders(shape: tuple[int, int, int], length: int) -> dict[str, Callable[[], Any]]:
    heads, kv_heads, d = shape
    g = torch.Generator().manual_seed(length)
    q = torch.randn(length, heads, d, generator=g)
    k, v = (torch.randn(length, kv_heads, d, generator=g).bfloat16() for _ in range(2))
    scale = d ** -0.5
    ref = sdpa(q, k, v, scale, torch.float32)
    runs: dict[str, Callable[[], Any]] = {}
    for isa in kernels.supported_isas("chunk_attention"):
        module = kernels.load("chunk_attention", isa)
        err = (module.chunk_attention(q, k, v, scale) - ref).abs().max().item()
        assert err < 1e-4, f"the {isa} kernel is {err} from SDPA in fp32"
        runs[f"kernel {isa}"] = lambda m=module: m.chunk_attention(q, k, v, scale)
    runs["sdpa bf16"] = lambda: sdpa(q, k, v, scale, torch.bfloat16)
    runs["sdpa fp32"] = lambda: sdpa(q, k, v, scale, torch.float32)
    return runs


def layer_times(lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name, shape in SHAPES.items():
        for length in lengths:
            runs = contenders(shape, length)
            times: dict[str, list[float]] = {k: [] for k in runs}
            for fn in runs.values():
                fn()
            for _ in range(repeats):
                for k, fn in runs.items():
                    t = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - t)
            us = {k: 1e6 * statistics.median(v) for k, v in times.items()}
            rows.append({"model": name, "tokens": length, "us": us})
            shown = ", ".join(f"{k} {v:,.0f} us" for k, v in us.items())
            print(f"{name:12} {length:5} tokens: {shown}", flush=True)
    return rows


def throughput(runs: int) -> dict[str, Any]:
    from kvserve.bench.throughput import make_workload
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.models.registry import default_model_path, load_weights
    loaded = load_weights(default_model_path())
    w = make_workload(64, loaded.config.vocab_size, (64, 192), (64, 192), 0)
    results: dict[str, list[dict[str, float]]] = {"kernel": [], "sdpa": []}
    for r in range(runs):
        for variant in results:
            engine = LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, max_model_len=1024,
                                            max_num_seqs=64, enable_prefix_caching=False)
            if variant == "sdpa":
                engine.runner.backend.chunks = None
            elif getattr(engine.runner.backend, "chunks", None) is None:
                raise SystemExit("this CPU's engine keeps no chunk kernel "
                                 "(kvserve.attention.cpu_kernel.chunk_kernel)")
            start, prompt_steps = time.perf_counter(), 0.0
            for p, n in zip(w.prompts, w.output_lens):
                engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            while engine.has_unfinished():
                before, t = engine.num_prompt_tokens_computed, time.perf_counter()
                engine.step()
                if engine.num_prompt_tokens_computed > before:
                    prompt_steps += time.perf_counter() - t
            elapsed = time.perf_counter() - start
            results[variant].append({"output_tok_s": w.num_output_tokens / elapsed,
                                     "prompt_steps_s": prompt_steps, "elapsed_s": elapsed})
            print(f"run {r} {variant}: {w.num_output_tokens / elapsed:.1f} output tok/s, prompt steps "
                  f"{prompt_steps:.2f} s of {elapsed:.2f}", flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in results.items()}
    print(f"medians of {runs}: " + "; ".join(f"{k} {v['output_tok_s']:.1f} tok/s, prompt steps "
                                             f"{v['prompt_steps_s']:.2f} s" for k, v in med.items()))
    return {"runs": results, "medians": med}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 132, 512, 1024])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--throughput", action="store_true",
                   help="also the offline throughput run, kernel against SDPA")
    p.add_argument("--runs", type=int, default=3, help="interleaved throughput runs of each")
    p.add_argument("--out", default=RESULT)
    a = p.parse_args()
    if kernels.load("chunk_attention") is None:
        raise SystemExit(f"the chunk_attention kernel is not built: {kernels.failure('chunk_attention')}")
    torch.set_num_threads(a.threads)
    flags = sorted(kernels.cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    result: dict[str, Any] = {"threads": a.threads, "cpu_flags": flags,
                              "layers": layer_times(a.lengths, a.repeats)}
    if a.throughput:
        result["throughput"] = throughput(a.runs)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
