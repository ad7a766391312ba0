"""Batch-1 decode with every decoder layer's decode step in one compiled call (layer_ops'
DecodeStack), with each layer's in one call (DecodeLayer: `ModelRunner.use_fast_path(stacked=False)`)
and with the layers' blocks called one by one (`use_fast_path(fused=False)`), in the same engine.

SmolLM2-135M-Instruct Q4_1 (the default GGUF) with the defaults, peers.py's decode: 128 greedy
steps from a 1-token prompt, tok/s. One engine, bound each way in turn, `--rounds` rounds with the
order rotating, so all see the machine's same minutes; medians and each round's ratios. Then the
forward pass alone of one decode step (its captured arguments, the 30th step of a decode), all
layers in one call against one call a layer, the two calls alternating (`--calls` of each): their
medians, without the engine's step around them.

    .venv/bin/python benchmarks/fused_layers.py            # writes benchmarks/results/fused_layers.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvserve.bench.history import now_utc  # noqa: E402
from kvserve.bench.machine import Machine, load_average  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.models.registry import default_model_path, load_weights  # noqa: E402
from kvserve.core.sampling_params import SamplingParams  # noqa: E402
from peers import kvserve  # noqa: E402  (benchmarks/peers.py: its batch-1 decode)


def forward_pass(engine: LLMEngine, calls: int) -> dict[str, float]:
    """Median us of one decode step's forward pass, all layers in one call (the bound fast forward)
    and one call a layer (the model's own forward over the layers' bound one calls), alternating."""
    engine.runner.use_fast_path(True)
    model = engine.runner.model
    stacked = model.__dict__.get("forward")
    if stacked is None:
        raise SystemExit("the model has no stacked forward here (kernels off or not built?)")
    captured: list[tuple[Any, ...]] = []

    def capture(*args: Any) -> Any:
        captured[:] = [args]
        return stacked(*args)
    with mock.patch.object(model, "forward", capture):
        engine.add_request("forward", [1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    args, layer_by_layer = captured[0], type(model).forward.__get__(model)
    times: dict[str, list[float]] = {"all layers in one call": [], "one call a layer": []}
    ways = [("all layers in one call", stacked), ("one call a layer", layer_by_layer)]
    for i in range(calls):
        for name, fn in ways if i % 2 == 0 else ways[::-1]:
            t = time.perf_counter()
            fn(*args)  # writes the step's K/V into the same slots again: the same values
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=600, help="forward passes of each binding")
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
    forward_us = forward_pass(engine, a.calls)
    print("one decode step's forward pass: " + ", ".join(f"{k} {v:,.0f} us" for k, v in forward_us.items())
          + f" (medians of {a.calls} each)")
    result = {"date": now_utc(), "machine": Machine.here(a.threads).as_dict(), "load_before": load,
              "rounds": a.rounds, "decode_tok_s": runs, "medians": medians, "ratios": ratios,
              "forward_pass_us": forward_us, "forward_calls": a.calls}
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fused_layers.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
