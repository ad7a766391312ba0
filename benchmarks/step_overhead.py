"""The Python cost of one engine step around the model: schedule, prepare the inputs (block
tables, slot mapping, metadata), update the requests. The model is not run (a stand-in samples
token 5), so the figure is the engine's own overhead per step, which at batch 64 is paid 64
times less often per token than at batch 1 but still every step.

64 running sequences decode from contexts of 500 and 2,000 tokens (block size 16, fp32 metadata
of a 2-layer random Llama: the model's size does not enter). Medians and means over 64 steps.
`--rev REV` measures a git revision of this repository the same way (in a worktree, in a
subprocess), so before and after print side by side:

    .venv/bin/python benchmarks/step_overhead.py --rev 598c93d

Writes benchmarks/results/step_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

NUM_SEQS, NUM_STEPS = 64, 64


def tiny_engine(max_len: int):
    import torch
    from kvserve.config import ModelConfig
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.models.llama import LlamaForCausalLM
    from kvserve.models.loaders.base import LoadedModel
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len, name="tiny")
    torch.manual_seed(0)
    sd = {k: v.detach().clone() for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    blocks = NUM_SEQS * (max_len // 16 + 2)
    return LLMEngine.from_options("tiny", loaded=LoadedModel(cfg, sd, None, "tiny"), num_blocks=blocks,
                                  max_num_seqs=NUM_SEQS, max_num_batched_tokens=8192, max_model_len=max_len)


def measure(context: int) -> dict:
    """Per-step milliseconds of schedule, prepare and update at NUM_SEQS decodes of `context`."""
    from kvserve.core.outputs import ModelRunnerOutput
    try:
        from kvserve.core.sampling_params import SamplingParams
    except ImportError:  # revisions before the move into core
        from kvserve.sampling_params import SamplingParams
    engine = tiny_engine(context + 2 * NUM_STEPS + 16)
    sched, runner = engine.scheduler, engine.runner
    def prepare(out):  # the inputs and the forward context, as a step builds them
        if not hasattr(runner, "prepare_step"):  # revisions before prepare_step
            return runner.prepare(out.scheduled)
        inp = runner.prepare_step(out)
        return runner.context(inp.common) if inp is not None and hasattr(runner, "context") else inp
    for i in range(NUM_SEQS):
        engine.add_request(None, [(i * 7 + j) % 500 for j in range(context)],
                           SamplingParams(max_tokens=4 * NUM_STEPS, ignore_eos=True))

    def fake(out):
        return ModelRunnerOutput({s.request_id: [5] for s in out.scheduled if s.num_samples})

    while any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.requests.values()) or sched.waiting:
        out = sched.schedule()  # prefill without the model: only the bookkeeping matters here
        prepare(out)
        sched.update(out, fake(out))
    times: dict[str, list[float]] = {"schedule": [], "prepare": [], "update": []}
    for _ in range(NUM_STEPS):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        prepare(out)
        t2 = time.perf_counter()
        sched.update(out, fake(out))
        t3 = time.perf_counter()
        assert len(out.scheduled) == NUM_SEQS
        for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[key].append(dt * 1e3)
    total = [a + b + c for a, b, c in zip(*times.values())]
    return {"context": context, **{f"{k}_ms_median": statistics.median(v) for k, v in times.items()},
            "total_ms_median": statistics.median(total), "total_ms_mean": statistics.fmean(total),
            "total_ms_max": max(total)}


def run_revision(rev: str) -> list[dict]:
    """The same measurement on another revision of this repository, in a worktree."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "tree")
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", tree, rev], check=True,
                       capture_output=True)
        try:
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--json-only"], env=env,
                                 cwd=tree, check=True, capture_output=True, text=True).stdout
        finally:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", tree], capture_output=True)
    return json.loads(out.strip().splitlines()[-1])


def show(label: str, rows: list[dict]) -> None:
    for r in rows:
        print(f"{label:>8} | context {r['context']:>5} | schedule {r['schedule_ms_median']:.2f} ms | "
              f"prepare {r['prepare_ms_median']:.2f} ms | update {r['update_ms_median']:.2f} ms | "
              f"total median {r['total_ms_median']:.2f} ms, mean {r['total_ms_mean']:.2f}, "
              f"max {r['total_ms_max']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", default=None, help="also measure this git revision (before)")
    p.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.json_only:
        print(json.dumps([measure(c) for c in (500, 2000)]))
        return
    result = {"num_seqs": NUM_SEQS, "steps": NUM_STEPS}
    if a.rev:
        result["before"] = {"rev": a.rev, "rows": run_revision(a.rev)}
        show(a.rev, result["before"]["rows"])
    result["after"] = {"rev": "HEAD", "rows": [measure(c) for c in (500, 2000)]}
    show("now", result["after"]["rows"])
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "step_overhead.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
