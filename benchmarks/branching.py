"""Branching the cache, measured on SmolLM2 (fp32 weights, CPU):

1. Beam search (k = 4) against Hugging Face generate(num_beams=4) on the same prompts: tokens/s
   (beam tokens produced), and the KV memory each holds at its peak (ours: blocks held, shared
   among beams; HF: its cache holds k full copies of the sequence).
2. Speculative decoding at batch 1 with n-gram prompt lookup (and a draft model: SmolLM2 itself
   with an int8 cache, for what a draft costs), on an input-grounded task (repeat a passage with
   small edits, where lookup finds what follows) and on free generation: acceptance rate, mean
   accepted length, speedup over plain decoding.
3. The same at batch 4 to 64 with the turn-off disabled, to show how the gain shrinks as the
   batch grows (the engine's default --speculative-disable-batch-size comes from here).

    .venv/bin/python benchmarks/branching.py

Writes benchmarks/results/branching.json.
"""

from __future__ import annotations

import json
import os
import time

import torch

from kvserve import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.models.registry import default_model_path, load_weights

PASSAGE = ("The cache keeps the keys and values of every token the model has seen. Each new token then "
           "costs one pass over the cache instead of a pass over the whole sequence. Blocks of sixteen "
           "tokens are handed out as a sequence grows and taken back when it ends, so memory follows what "
           "is really used. Requests that share a prompt share its blocks.")
GROUNDED = [f"Repeat this passage word for word, then stop:\n\n{PASSAGE}",
            f"Copy the following text exactly:\n\n{PASSAGE}"]
FREE = ["Write a short story about a robot who learns to paint.", "Describe your ideal weekend in detail."]
BEAM_PROMPTS = ["The capital of France is", "The best way to learn a language is", "Once upon a time",
                "The three primary colours are"]


def engine(loaded, **options) -> LLMEngine:
    return LLMEngine.from_options("bench", loaded=loaded, max_model_len=1024, num_blocks=2400, **options)


def generate(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    ids = [eng.add_request(None, p, params) for p in prompts]
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return time.perf_counter() - start, [done[i] for i in ids]


def beam_row(loaded, hf) -> dict:
    tok = loaded.tokenizer
    prompts = [tok.encode(p) for p in BEAM_PROMPTS]
    params = SamplingParams(use_beam_search=True, beam_width=4, n=4, temperature=0, max_tokens=32, ignore_eos=True)
    eng = engine(loaded)
    peak = 0
    start = time.perf_counter()
    for p in prompts:  # one request at a time, as HF's loop below
        eng.add_request(None, p, params)
        while eng.has_unfinished():
            eng.step()
            peak = max(peak, eng.kv.pool.num_used_blocks)
    ours_s = time.perf_counter() - start
    ours_bytes = peak * eng.plan.block_bytes
    per_token = eng.plan.kv_format.bytes_per_token(loaded.config, 16)
    start = time.perf_counter()
    with torch.no_grad():
        for p in prompts:
            hf.generate(torch.tensor([p]), num_beams=4, num_return_sequences=4, do_sample=False, max_new_tokens=32,
                        min_new_tokens=32, pad_token_id=0)
    hf_s = time.perf_counter() - start
    hf_bytes = 4 * (max(len(p) for p in prompts) + 32) * per_token  # k full sequences in its cache
    tokens = 4 * 32 * len(prompts)
    return {"prompts": len(prompts), "beam_width": 4, "new_tokens": 32, "ours_tok_s": tokens / ours_s,
            "hf_tok_s": tokens / hf_s, "ours_peak_kv_bytes": ours_bytes, "hf_peak_kv_bytes": hf_bytes,
            "ours_peak_blocks": peak}


def spec_row(loaded, prompts: list[list[int]], label: str, batch: int, method: str, max_tokens: int = 96,
             **spec) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    work = (prompts * batch)[:max(batch, len(prompts))]
    plain_s, plain = generate(engine(loaded, max_num_seqs=batch), work, params)
    eng = engine(loaded, max_num_seqs=batch, speculative=method, num_speculative_tokens=4,
                 speculative_disable_batch_size=1024, **spec)
    spec_s, outs = generate(eng, work, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]  # greedy: the same
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = sum(o.metrics.num_spec_steps for o in outs)
    return {"task": label, "batch": batch, "method": method, "tokens": n, "plain_tok_s": n / plain_s,
            "spec_tok_s": n / spec_s, "speedup": plain_s / spec_s,
            "acceptance_rate": eng.num_spec_accepted / max(eng.num_spec_proposed, 1),
            "mean_accepted_length": sum(o.metrics.num_spec_accepted for o in outs) / max(steps, 1)}


def main() -> None:
    import transformers
    loaded = load_weights("SmolLM2-135M-Instruct")
    tok = loaded.tokenizer
    chat = lambda text: tok.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    grounded, free = [chat(t) for t in GROUNDED], [chat(t) for t in FREE]
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32).eval()
    result: dict = {"beam": beam_row(loaded, hf)}
    print(json.dumps(result["beam"]), flush=True)
    rows = []
    for label, prompts in (("grounded", grounded), ("free", free)):
        rows.append(spec_row(loaded, prompts[:1], label, 1, "ngram"))
        print(json.dumps(rows[-1]), flush=True)
    rows.append(spec_row(loaded, grounded[:1], "grounded", 1, "draft", speculative_model=path,
                         max_tokens=48))
    print(json.dumps(rows[-1]), flush=True)
    for batch in (4, 8, 16, 32, 48, 64):
        rows.append(spec_row(loaded, grounded, "grounded", batch, "ngram", max_tokens=64))
        print(json.dumps(rows[-1]), flush=True)
    result["speculative"] = rows
    b = result["beam"]
    print(f"\nbeam search k=4: {b['ours_tok_s']:.1f} tok/s vs HF {b['hf_tok_s']:.1f} "
          f"({b['ours_tok_s'] / b['hf_tok_s']:.2f}x); peak KV {b['ours_peak_kv_bytes'] / 2**20:.1f} MiB "
          f"vs HF {b['hf_peak_kv_bytes'] / 2**20:.1f} MiB")
    print("| task | batch | proposer | acceptance | mean accepted | plain tok/s | speculative tok/s | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['batch']} | {r['method']} | {100 * r['acceptance_rate']:.0f}% | "
              f"{r['mean_accepted_length']:.2f} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x |")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "branching.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
