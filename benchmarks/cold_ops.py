"""What a small torch op costs the first time after a batch-1 decode step of the default model,
against the same op again at once and after the thread slept 2 ms: why the engine's Python
around the kernels costs several times what the same lines cost in a loop.

A decode step of SmolLM2-135M-Instruct Q4_1 streams about 92 MiB of weights through the caches
(more than any cache here holds), so what the step's Python runs next (the scheduler, the
inputs' tensors, sampling, output processing) finds its code and data evicted: each distinct
op pays for its instructions and data again. Timed between the steps of one greedy request
(medians over the steps), for ops the engine's step makes: a tensor from nested lists (the
decode inputs), unbind (their rows), index_select (rope angles), empty.

    .venv/bin/python benchmarks/cold_ops.py [--steps 200]

Writes benchmarks/results/cold_ops.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable

import torch

from kvserve.bench.machine import Machine, load_average

OUT = os.path.join(os.path.dirname(__file__), "results", "cold_ops.json")


def ops() -> dict[str, Callable[[], Any]]:
    rows = torch.tensor([[5], [6], [7], [8], [9]])
    table = torch.randn(4096, 32)
    index = torch.tensor([17])
    return {
        "torch.tensor([[..] x 5])": lambda: torch.tensor([[1], [2], [3], [4], [5]], dtype=torch.long),
        "unbind(0) of [4, 1]": lambda: rows[:4].unbind(0),
        "index_select of 1 row": lambda: table.index_select(0, index),
        "torch.empty(1, 576)": lambda: torch.empty(1, 576),
    }


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    load = load_average()
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_options("SmolLM2-135M-Instruct", max_model_len=1024, num_blocks=128,
                                    enable_prefix_caching=False)
    engine.add_request("cold", [1], SamplingParams(temperature=0, max_tokens=a.steps + 8, ignore_eos=True))
    engine.step()
    cases = ops()
    conditions = ("after a step", "again at once", "after 2 ms asleep")
    got: dict[str, dict[str, list[float]]] = {name: {c: [] for c in conditions} for name in cases}
    step_ms = []
    names, threads = list(cases), torch.get_num_threads()
    for i in range(a.steps):
        t = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - t) * 1e3)
        name = names[i % len(names)]  # one op a step: each finds the step's caches
        fn = cases[name]
        got[name]["after a step"].append(timed(fn))
        got[name]["again at once"].append(timed(fn))
        time.sleep(0.002)
        got[name]["after 2 ms asleep"].append(timed(fn))
    medians = {name: {k: round(statistics.median(v), 2) for k, v in c.items()} for name, c in got.items()}
    print(f"batch-1 decode step of the default model: median {statistics.median(step_ms):.2f} ms; "
          f"{threads} thread(s)")
    print(f"{'op':28} {conditions[0]:>14} {conditions[1]:>14} {conditions[2]:>18}   (us, medians)")
    for name, m in medians.items():
        print(f"{name:28} {m[conditions[0]]:14.1f} {m[conditions[1]]:14.1f} {m[conditions[2]]:18.1f}")
    with open(OUT, "w") as f:
        json.dump({"machine": Machine.here(threads).as_dict(), "load_before": load, "steps": a.steps,
                   "step_ms_median": statistics.median(step_ms), "threads": threads, "op_us": medians},
                  f, indent=1)
    print(f"wrote {os.path.relpath(OUT)}")


if __name__ == "__main__":
    main()
