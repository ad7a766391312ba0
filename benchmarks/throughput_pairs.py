"""Two engine settings on the peers' offline throughput workload, by turns in one process: how
much of a gap between two rows of `benchmarks/peers.py`'s throughput table is the settings' own.

peers.py runs its contenders one after another, each a fresh engine, in a fixed order. On a
machine whose freed memory goes back to its host (a KVM or Firecracker guest with free page
reporting), a fresh engine's KV cache pages cost a wait on their first write (docs/cache.md),
and how long depends on what ran just before: a contender after vLLM's process, or first, gets
memory back from the host; one after another kvserve engine, pages that engine freed moments
ago. Here the two settings alternate, the order swapped every pair, each engine fresh, and the
figure is the median of the pairs' ratios (B over A) beside each setting's median.

SmolLM2-135M-Instruct Q4_1 (the default GGUF), the workload of peers.py (64 requests, prompts
and outputs of 64-192 tokens, EOS ignored, seed 0), max_model_len 1024, no prefix caching:

    .venv/bin/python benchmarks/throughput_pairs.py --b --kv-cache-populate
    .venv/bin/python benchmarks/throughput_pairs.py --b --packed-activations int8 --both --kv-cache-populate

`--a` and `--b` take engine flags (as `kvserve generate` does; none: the defaults), `--both`
flags that both settings get. Writes benchmarks/results/throughput_pairs.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import options_of  # noqa: E402

from kvserve.bench.throughput import make_workload, run_kvserve  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.models.registry import default_model_path, load_weights  # noqa: E402

RESULT = Path(__file__).parent / "results" / "throughput_pairs.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=(
        "--a FLAGS..., --b FLAGS..., --both FLAGS...: engine flags of setting A, of setting B, of both (each "
        "list runs to the next of these or of the options above)"))
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    args, flags = _split(sys.argv[1:])
    a = p.parse_args(args)
    if a.pairs < 1:
        p.error("--pairs must be at least 1")
    torch.set_num_threads(a.threads)
    settings = {"A": flags["--a"] + flags["--both"], "B": flags["--b"] + flags["--both"]}
    options = {k: options_of(v) for k, v in settings.items()}  # bad flags fail here, before any run
    loaded = load_weights(default_model_path())
    w = make_workload(64, loaded.config.vocab_size, (64, 192), (64, 192), 0)
    runs: dict[str, list[float]] = {k: [] for k in settings}
    for i in range(a.pairs):
        for name in (["A", "B"] if i % 2 == 0 else ["B", "A"]):
            engine = LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, **{
                "max_model_len": 1024, "max_num_seqs": len(w.prompts), "enable_prefix_caching": False,
                **options[name]})
            runs[name].append(run_kvserve(engine, w)["output_tokens_per_s"])
            engine.close()
            del engine
            gc.collect()
        print(f"pair {i}: A {runs['A'][-1]:.1f}, B {runs['B'][-1]:.1f} output tok/s", flush=True)
    ratios = [b / x for x, b in zip(runs["A"], runs["B"])]
    medians = {k: statistics.median(v) for k, v in runs.items()}
    for k in settings:
        flags_k = " ".join(settings[k]) or "(defaults)"
        print(f"{k} {flags_k}: {medians[k]:.1f} output tok/s (median of {a.pairs})")
    print(f"B / A, median of the pairs' ratios: {statistics.median(ratios):.3f} "
          f"(pairs {', '.join(f'{r:.3f}' for r in ratios)})")
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({"settings": settings, "threads": a.threads, "runs": runs,
                                  "medians": medians, "ratios": ratios,
                                  "median_ratio": statistics.median(ratios)}, indent=1) + "\n")
    print(f"wrote {RESULT}")


def _split(argv: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The script's own arguments, and the engine flags after each of --a, --b and --both (up to
    the next of those or of the script's own options)."""
    own = {"--pairs", "--threads", "-h", "--help"}
    flags: dict[str, list[str]] = {"--a": [], "--b": [], "--both": []}
    rest: list[str] = []
    into = None
    it = iter(argv)
    for arg in it:
        if arg in flags:
            into = flags[arg]
        elif arg in own:
            into = None
            rest.append(arg)
            if arg in ("--pairs", "--threads"):
                rest.append(next(it, ""))
        elif into is not None:
            into.append(arg)
        else:
            rest.append(arg)
    return rest, flags


if __name__ == "__main__":
    main()
