"""`kvserve visualize`: a step-through of what a real engine did to its KV cache, as one
self-contained HTML file (no server, no network).

Without --trace it runs a small scenario on a small model (stories260K by default) with a small
pool, chosen so that every mechanism shows up in a few dozen steps:
  A      a prompt fills blocks in one prefill step, then each decode step appends one K/V row
         in every layer;
  B      the same opening as A: its full blocks are prefix-cache hits, shared (ref 2);
  C      n = 2: both samples share the prompt's blocks, and the first write into the shared
         last block copies it (copy-on-write);
  D, E   long prompts into a nearly full pool: cached blocks are evicted, a request is
         preempted and later recomputed.
With --trace FILE it draws a trace recorded by any run (`kvserve generate --trace FILE`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.trace import StepTrace, load_trace

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park"
SCENARIO: list[tuple[int, str, str, SamplingParams]] = [  # (add before step, id, prompt, params)
    (0, "A", STORY + ".", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
    (5, "B", STORY + " with her dog.", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
    (10, "C", "Tom had a big red ball", SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=28,
                                                      ignore_eos=True)),
    (16, "D", "One day, a little boy named Ben went to the forest with his mom. They saw a big tree and "
              "many birds. Ben was happy and he wanted to climb", SamplingParams(temperature=0, max_tokens=36,
                                                                                ignore_eos=True)),
    (20, "E", "The sun was hot and the sky was blue. A cat sat on the wall and looked at the fish in the "
              "pond. The cat was hungry", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
]
SCENARIO_OPTIONS = {"block_size": 8, "num_blocks": 20, "max_num_seqs": 4, "enable_prefix_caching": True,
                    "preemption_mode": "recompute"}


def default_small_model() -> Optional[str]:
    """stories260K where the project keeps it (../shared/models beside the checkout)."""
    here = Path(__file__).resolve()
    for root in here.parents:
        candidate = root / "shared" / "models" / "stories260K"
        if (candidate / "stories260K.bin").exists():
            return str(candidate)
    return None


def record_scenario(model: str, trace_path: Optional[str] = None, **options: Any) -> list[dict[str, Any]]:
    """The scenario's trace (also written to trace_path, as --trace writes one)."""
    from kvserve.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_options(model, **{**SCENARIO_OPTIONS, **options})
    engine.trace = trace = StepTrace(engine, trace_path)
    pending = list(SCENARIO)
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        if engine.has_unfinished():
            engine.step()
        step += 1
    trace.close()
    return trace.records


def render(records: list[dict[str, Any]]) -> str:
    from importlib.resources import files
    page = files("kvserve.server").joinpath("static", "visualize.html").read_text(encoding="utf-8")
    data = json.dumps(records).replace("</", "<\\/")  # nothing in the data can close the script
    return page.replace("/*__TRACE__*/null", data)


def visualize(out: str, model: Optional[str] = None, trace: Optional[str] = None,
              save_trace: Optional[str] = None) -> dict[str, Any]:
    """Write the page; returns what it shows in figures."""
    if trace is not None:
        records = load_trace(trace)
    else:
        model = model or default_small_model()
        if model is None:
            raise FileNotFoundError("stories260K is not in ../shared/models: name a model with --model")
        records = record_scenario(model, save_trace)
    Path(out).write_text(render(records), encoding="utf-8")
    return summarize(records)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [r for r in records if r["kind"] == "step"]
    last = steps[-1]["state"]["totals"] if steps else {}
    return {"steps": len(steps), "copy_on_write": sum(len(s["copy_on_write"]) for s in steps),
            "preemptions": last.get("preemptions", 0), "evictions": last.get("evictions", 0),
            "prefix_hit_rate": last.get("prefix_hit_rate", 0.0),
            "swaps": sum(len(s["swap_out"]) for s in steps)}
