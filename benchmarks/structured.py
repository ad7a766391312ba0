"""What structured outputs cost: SmolLM2 output tok/s with a JSON schema vs unconstrained, at
batch 1 and 32 (every request of a batch constrained, or none), interleaved, medians of repeats.
The schema asks for a long output (30 to 40 short strings) so both run their full max_tokens;
decode tokens only (timed from the step after which every request has its first token). The
per-token cost is the matcher's mask (llguidance), applied in the sampler to the
constrained rows only.

    .venv/bin/python benchmarks/structured.py [--dtype bfloat16] [--tokens 96] [--repeats 3]

Writes benchmarks/results/structured.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.models.registry import load_weights

RESULTS = Path(__file__).parent / "results" / "structured.json"
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 30, "maxItems": 40,
                                                     "items": {"type": "string", "maxLength": 30}}},
          "required": ["items"], "additionalProperties": False}


def tok_s(engine: LLMEngine, batch: int, tokens: int, constrained: bool) -> tuple[float, int]:
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "List many fruits as JSON."}])
    for i in range(batch):
        structured = ("json_schema", json.dumps(SCHEMA)) if constrained else None
        engine.add_request(None, prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=tokens,
                                                        ignore_eos=not constrained, structured=structured))
    # decode only: timed from the step after which every request has its first token
    counts: dict[str, int] = {}
    t0, at_t0 = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if t0 is None and len(counts) == batch:
            t0, at_t0 = time.perf_counter(), sum(counts.values())
    assert t0 is not None
    generated = sum(counts.values())
    return (generated - at_t0) / (time.perf_counter() - t0), generated


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    loaded = load_weights("SmolLM2-135M-Instruct")
    rows = {}
    for batch in (1, 32):
        engine = LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, dtype=a.dtype, max_num_seqs=batch,
                                        max_model_len=1024)
        tok_s(engine, batch, 8, True)  # warm-up: kernels, the matcher's tokenizer
        runs: dict[str, list[float]] = {"free": [], "json_schema": []}
        counts: dict[str, int] = {}
        for _ in range(a.repeats):
            for name in runs:
                speed, counts[name] = tok_s(engine, batch, a.tokens, name == "json_schema")
                runs[name].append(speed)
        free, constrained = statistics.median(runs["free"]), statistics.median(runs["json_schema"])
        rows[batch] = {"free_tok_s": free, "json_schema_tok_s": constrained, "ratio": constrained / free,
                       "tokens": counts}
        print(f"batch {batch:>2}: unconstrained {free:7.1f} tok/s, JSON schema {constrained:7.1f} tok/s "
              f"({100 * (constrained / free - 1):+.1f}%), tokens {counts}", flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"dtype": a.dtype, "tokens": a.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
