"""Where a decode step of the default model goes: the kernels (packed products, attention and its
cache write, the layer ops: norms, RoPE, SiLU) against everything else (the scheduler, the
step's inputs and metadata, Python between the kernels in the forward pass, sampling, output
processing and the engine's own bookkeeping).

SmolLM2-135M-Instruct Q4_1 (the default GGUF, 30 layers), greedy decodes of B requests from
prompts of 32 tokens (`--prompt-len`), with packed activations int8 and float (`--acts`; auto:
the defaults' policy, AMX tiles above 24 rows), on 2 and 1 threads, B = 1, 16, 64, over the
engine's default KV cache or another format (`--kv-cache-dtype`).
For each: the plain step time (median over the steps, nothing timed inside) and, over the same
number of further steps, each part's own time, timed by wrapping the engine's methods and every
function of the compiled kernels (in this script only; `--clock cpu` times this thread's CPU
time, which a loaded machine's waits do not inflate: use it with one thread). The timed steps
call each kernel on its own: a decoder layer run as one compiled call would call them unseen, so
the parts are those of the fast path without it (`use_fast_path(fused=False)`), whose step the
"instrumented" figure is, and the plain step the engine's own. Parts are means over the
steps left after dropping the slowest tenth (the 2 cores are shared), so they add up to the step;
the timers' own cost (measured: calls a step times the cost of one timed call) is shown as
"timers" and taken out of the forward's Python. "non-kernel" is the instrumented step less the
kernels and the timers: the scheduler, the inputs, Python in the forward pass, sampling, output
processing and the engine's bookkeeping, what is to stay under 1 ms a step at batch 1.

    .venv/bin/python benchmarks/decode_step.py                 # the table, results JSON
    .venv/bin/python benchmarks/decode_step.py --rev 35431e2   # that revision first, side by side

`--rev REV` measures a git revision of this repository the same way (exported with git archive,
with this tree's kernel builds, in a subprocess). Writes benchmarks/results/decode_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any, Callable, Optional

PROMPT_LEN, WARMUP = 32, 6  # the prompt's tokens by default, steps before timing
# which kernel functions count as what (every other function of a kernel: "other kernels")
KERNEL_PARTS = {
    "products": ("linear_q8", "linear_quant", "linear_bf16", "linear_few_rows", "linear",
                 "linear_bf16_tiles"),
    "attention": ("paged_decode", "paged_decode_int8", "paged_decode_fp8", "paged_decode_int4", "store_kv",
                  "store_kv_int8"),
    "layer ops": ("rms_norm", "add_rms_norm", "rope_qkv", "rotate_halves", "silu_mul", "silu_mul_halves"),
}
# engine methods timed (exclusive of what is timed inside them), by part; missing ones are skipped
METHODS = {
    "scheduler": [("kvserve.core.scheduler", "Scheduler", ("schedule", "update"))],
    "prepare": [("kvserve.runner.model_runner", "ModelRunner", ("prepare_step", "context"))],
    "forward (Python)": [("kvserve.models.llama", "LlamaForCausalLM", ("forward",))],
    "sampling": [("kvserve.runner.model_runner", "ModelRunner", ("_sample",))],
    "outputs": [("kvserve.engine.output_processor", "OutputProcessor", ("process", "output"))],
}
ROWS = ("scheduler", "prepare", "forward (Python)", "sampling", "outputs", "engine other",
        "products", "attention", "layer ops", "other kernels")
SHOWN = ROWS + ("timers",)
KERNEL_ROWS = ("products", "attention", "layer ops", "other kernels")


CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
clock_ns = CLOCKS["wall"]  # --clock cpu: this thread's CPU time (a shared machine's waits left out)


class Timers:
    """Exclusive time by part: a timed call nested in another counts for itself only."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.calls = 0
        self._stack: list[int] = []
        self._restore: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, part: str) -> None:
        original: Callable[..., Any] = getattr(owner, attr)
        stack, ns, clock = self._stack, self.ns, clock_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            stack.append(0)
            try:
                return original(*args, **kwargs)
            finally:
                inner = stack.pop()
                elapsed = clock() - t0
                ns[part] += elapsed - inner
                if stack:
                    stack[-1] += elapsed
                self.calls += 1

        self._restore.append((owner, attr, owner.__dict__.get(attr) if isinstance(owner, type) else original))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, original in reversed(self._restore):
            setattr(owner, attr, original)
        self._restore.clear()

    def take(self) -> dict[str, int]:
        out = dict(self.ns)
        self.ns.clear()  # in place: the wrappers hold this dict
        return out


def timer_cost_ns(repeats: int = 5, n: int = 20000) -> float:
    """What one timed call adds to a call (the best of a few tries): the wrappers' own cost."""
    from types import SimpleNamespace
    bare, timed = SimpleNamespace(f=abs), SimpleNamespace(f=abs)
    timers = Timers()
    timers.wrap(timed, "f", "calibration")
    best = float("inf")
    for _ in range(repeats):
        t0 = clock_ns()
        for _ in range(n):
            bare.f(1)
        t1 = clock_ns()
        for _ in range(n):
            timed.f(1)
        best = min(best, ((clock_ns() - t1) - (t1 - t0)) / n)
    return best


def kernel_part(name: str) -> str:
    return next((part for part, names in KERNEL_PARTS.items() if name in names), "other kernels")


def bind_unfused(engine: Any) -> None:
    """Bind the fast path with each kernel called on its own (no decoder layer as one compiled
    call, which would call them unseen by the timers); revisions before that option had none."""
    import inspect
    if "fused" in inspect.signature(engine.runner.use_fast_path).parameters:
        engine.runner.use_fast_path(True, fused=False)
    else:
        engine.runner.use_fast_path(True)


def instrument(timers: Timers, engine: Any) -> None:
    """Wrap the engine's methods and every kernel function, then bind the fast path again so
    its closures take the wrapped kernels, each kernel called on its own (bind_unfused)."""
    import importlib
    from kvserve.bench.breakdown import kernel_functions
    for part, entries in METHODS.items():
        for module, cls_name, attrs in entries:
            cls = getattr(importlib.import_module(module), cls_name)
            for attr in attrs:
                if attr in cls.__dict__:
                    timers.wrap(cls, attr, part)
    for module, attr in kernel_functions():
        timers.wrap(module, attr, kernel_part(attr))
    for m in engine.runner.model.modules():  # a packed linear's AMX tiles product, held by the module
        if callable(getattr(m, "tiles", None)):
            timers.wrap(m, "tiles", "products")
    bind_unfused(engine)


def make_engine(loaded: Any, acts: str, batch: int, max_tokens: int, prompt_len: int,
                kv_cache_dtype: Optional[str] = None) -> Any:
    from kvserve.engine.llm_engine import LLMEngine
    blocks_per_seq = (prompt_len + max_tokens) // 16 + 2
    cache = {} if kv_cache_dtype is None else {"kv_cache_dtype": kv_cache_dtype}
    return LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, packed_activations=acts,
                                  num_blocks=batch * blocks_per_seq + 8, max_num_seqs=max(batch, 1),
                                  max_model_len=prompt_len + max_tokens + 16, **cache)


def greedy_params(max_tokens: int) -> Any:
    try:
        from kvserve.core.sampling_params import SamplingParams
    except ImportError:  # revisions before the move into core
        from kvserve.sampling_params import SamplingParams  # type: ignore[no-redef]
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def trimmed(values: list[float]) -> list[int]:
    """Indices of the steps kept: all but the slowest tenth."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[:max(1, len(values) - len(values) // 10)]


def measure(loaded: Any, acts: str, threads: int, batch: int, steps: int,
            prompt_len: int = PROMPT_LEN, kv_cache_dtype: Optional[str] = None) -> dict:
    """One configuration: plain step times, then the parts over as many timed steps."""
    import torch
    torch.set_num_threads(threads)
    max_tokens = WARMUP + 2 * steps + 8
    engine = make_engine(loaded, acts, batch, max_tokens, prompt_len, kv_cache_dtype)
    for i in range(batch):
        engine.add_request(None, [(37 * i + 11 * j) % 5000 + 100 for j in range(prompt_len)],
                           greedy_params(max_tokens))
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.requests.values()) \
            or engine.scheduler.waiting:
        engine.step()  # the prompts
    for _ in range(WARMUP):
        engine.step()
    plain = []
    for _ in range(steps):
        t0 = clock_ns()
        engine.step()
        plain.append((clock_ns() - t0) / 1e6)
    timers = Timers()
    instrument(timers, engine)
    try:
        per_step, totals = [], []
        for _ in range(steps):
            timers.take()
            t0 = clock_ns()
            engine.step()
            totals.append((clock_ns() - t0) / 1e6)
            per_step.append({k: v / 1e6 for k, v in timers.take().items()})
        calls = timers.calls / steps
    finally:
        timers.restore()
        engine.runner.use_fast_path(True)
    kept = trimmed(totals)
    parts = {row: statistics.fmean(per_step[i].get(row, 0.0) for i in kept) for row in ROWS}
    step = statistics.fmean(totals[i] for i in kept)
    timers_ms = calls * timer_cost_ns() / 1e6
    parts["engine other"] = step - sum(v for k, v in parts.items() if k != "engine other")
    # nearly every timed call is a kernel called from the forward pass: the timers' cost is taken
    # out of the forward's Python and shown on its own
    parts["forward (Python)"] -= timers_ms
    parts["timers"] = timers_ms
    kernel_ms = sum(parts[k] for k in KERNEL_ROWS)
    return {"acts": acts, "threads": threads, "batch": batch, "plain_step_ms": statistics.median(plain),
            "tokens_per_s": batch * 1e3 / statistics.median(plain), "instrumented_step_ms": step,
            "timed_calls_per_step": calls, "parts_ms": parts, "kernel_ms": kernel_ms,
            "non_kernel_ms": step - kernel_ms - timers_ms}


def run_all(acts_list: list[str], threads_list: list[int], batches: list[int], steps: int,
            prompt_len: int = PROMPT_LEN, kv_cache_dtype: Optional[str] = None) -> list[dict]:
    from kvserve.models.registry import load_weights
    loaded = load_weights("SmolLM2-135M-Instruct")
    return [measure(loaded, acts, threads, batch, steps, prompt_len, kv_cache_dtype)
            for acts in acts_list for threads in threads_list for batch in batches]


def run_revision(rev: str, argv: list[str]) -> list[dict]:
    """The same measurement on another revision of this repository, exported to a temporary
    directory that takes this tree's kernel builds (usable where that revision's kernel sources
    are the ones built; a stale build runs the torch paths, and kvserve says so)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.run(["git", "-C", repo, "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        built = os.path.join("kvserve", "kernels", "built")
        shutil.copytree(os.path.join(repo, built), os.path.join(tree, built), dirs_exist_ok=True)
        script = os.path.join(tree, "benchmarks", "decode_step.py")
        if not os.path.exists(script):
            script = os.path.abspath(__file__)
        env = {**os.environ, "PYTHONPATH": tree}
        done = subprocess.run([sys.executable, script, "--json-only", *argv], env=env, cwd=tree,
                              capture_output=True, text=True)
        if done.returncode != 0:  # e.g. an option that revision does not have
            raise SystemExit(f"revision {rev} failed:\n{done.stderr.strip()}")
        out = done.stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def show(label: str, rows: list[dict]) -> None:
    head = f"{'':>8} {'acts':>5} {'thr':>3} {'B':>3} | {'step':>6} {'tok/s':>7} | " + \
        " ".join(f"{r[:10]:>10}" for r in SHOWN) + f" | {'kernels':>7} {'non-kern':>8}"
    print(head)
    for r in rows:
        p = r["parts_ms"]
        print(f"{label:>8} {r['acts']:>5} {r['threads']:>3} {r['batch']:>3} | {r['plain_step_ms']:6.2f} "
              f"{r['tokens_per_s']:7.1f} | " + " ".join(f"{p[k]:10.3f}" for k in SHOWN) +
              f" | {r['kernel_ms']:7.2f} {r['non_kernel_ms']:8.2f}")
    print(f"(ms a step; parts timed over the instrumented steps, whose time is "
          f"{', '.join(format(r['instrumented_step_ms'], '.2f') for r in rows)} ms)")


def main() -> None:
    from kvserve.config import PACKED_ACTIVATIONS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", default=None, help="also measure this git revision (before)")
    p.add_argument("--acts", nargs="+", default=["int8", "float"], choices=list(PACKED_ACTIVATIONS),
                   help="packed activations (auto: the defaults' product policy)")
    p.add_argument("--threads", nargs="+", type=int, default=[2, 1])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help="tokens of each sequence's prompt")
    p.add_argument("--kv-cache-dtype", default=None, help="the KV cache's format (default: the engine's)")
    p.add_argument("--clock", choices=list(CLOCKS), default="wall",
                   help="wall time, or this thread's CPU time (on a loaded machine; exact for 1 thread only: "
                        "kernel threads other than the caller's are not counted)")
    p.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    global clock_ns
    clock_ns = CLOCKS[a.clock]
    argv = ["--clock", a.clock, "--acts", *a.acts, "--threads", *map(str, a.threads), "--batch", *map(str, a.batch),
            "--steps", str(a.steps)]
    if a.prompt_len != PROMPT_LEN:  # (revisions before the option take the default only)
        argv += ["--prompt-len", str(a.prompt_len)]
    if a.kv_cache_dtype is not None:  # (likewise)
        argv += ["--kv-cache-dtype", a.kv_cache_dtype]
    if a.json_only:
        print(json.dumps(run_all(a.acts, a.threads, a.batch, a.steps, a.prompt_len, a.kv_cache_dtype)))
        return
    result: dict[str, Any] = {"model": "SmolLM2-135M-Instruct Q4_1", "prompt_len": a.prompt_len,
                              "kv_cache_dtype": a.kv_cache_dtype or "default", "steps": a.steps,
                              "clock": a.clock}
    if a.rev:
        result["before"] = {"rev": a.rev, "rows": run_revision(a.rev, argv)}
        show(a.rev, result["before"]["rows"])
    result["after"] = {"rev": _head(), "rows": run_all(a.acts, a.threads, a.batch, a.steps, a.prompt_len,
                                                       a.kv_cache_dtype)}
    show("now", result["after"]["rows"])
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "decode_step.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


def _head() -> Optional[str]:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "") if done.returncode == 0 else None


if __name__ == "__main__":
    main()
