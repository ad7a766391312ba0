"""Batch-1 decode with every decoder layer's decode step in one compiled call (layer_ops'
DecodeStack), with each layer's in one call (DecodeLayer: `ModelRunner.use_fast_path(stacked=False)`)
and with the layers' blocks called one by one (`use_fast_path(fused=False)`), in the same engine.

SmolLM2-135M-Instruct Q4_1 (the default GGUF) with the defaults, peers.py's decode: 128 greedy
steps from a 1-token prompt, tok/s. One engine, bound each way in turn, `--rounds` rounds with the
order rotating, so all see the machine's same minutes; medians and each round's ratios.

    .venv/bin/python benchmarks/fused_layers.py            # writes benchmarks/results/fused_layers.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvserve.bench.history import now_utc  # noqa: E402
from kvserve.bench.machine import Machine, load_average  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.models.registry import default_model_path, load_weights  # noqa: E402
from peers import kvserve  # noqa: E402  (benchmarks/peers.py: its batch-1 decode)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    loaded = load_weights(default_model_path())
    engine = LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, max_model_len=1024,
                                    num_blocks=128, enable_prefix_caching=False)
    vocab = loaded.config.vocab_size
    kvserve(engine, vocab)  # warm up
    ways = ("all layers in one call", "one call a layer", "blocks one by one")
    runs: dict[str, list[float]] = {w: [] for w in ways}
    load = load_average()
    for r in range(a.rounds):
        for way in ways[r % 3:] + ways[:r % 3]:
            engine.runner.use_fast_path(True, fused=way != "blocks one by one", stacked=way == ways[0])
            runs[way].append(kvserve(engine, vocab)["decode"])
    engine.runner.use_fast_path(True)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    for k, v in runs.items():
        print(f"{k:22} median {medians[k]:6.1f} tok/s   " + " ".join(f"{x:.1f}" for x in v))
    ratios = {}
    for faster, slower in zip(ways, ways[1:]):
        each = [f / u for f, u in zip(runs[faster], runs[slower])]
        ratios[f"{faster} / {slower}"] = each
        print(f"{faster} / {slower}: medians {medians[faster] / medians[slower]:.3f}, rounds "
              f"{min(each):.3f}-{max(each):.3f} (median {statistics.median(each):.3f})")
    result = {"date": now_utc(), "machine": Machine.here(a.threads).as_dict(), "load_before": load,
              "rounds": a.rounds, "decode_tok_s": runs, "medians": medians, "ratios": ratios}
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fused_layers.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
