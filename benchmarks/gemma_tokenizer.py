"""Building Gemma-3-270M's tokenizer from its GGUF vocabulary (262,144 tokens, no merges in the
file): where the time goes, medians of --runs builds in this process.

    merges       the merges the vocabulary implies (tokenizer.hf.vocabulary_merges)
    build        the whole from_gguf_spm (merges included)
    plain_copy   the first encode_plain: the copy that reads special text as text, which shares
                 the built model
    full_copy    what that copy cost when it serialized the tokenizer and parsed it again

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


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def one_run(meta: dict) -> dict[str, float]:
    from kvserve.tokenizer import hf
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    spelled = [hf.SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    _, merges_s = timed(lambda: hf.vocabulary_merges({t: i for i, t in enumerate(spelled)}))
    tok, build_s = timed(lambda: hf.from_gguf_spm(tokens, types, 2, [1], True, None))
    _, plain_s = timed(lambda: tok.encode_plain("<start_of_turn>user"))
    _, full_s = timed(lambda: type(tok.tok).from_str(tok.tok.to_str()))
    return {"merges_s": merges_s, "build_s": build_s, "plain_copy_s": plain_s, "full_copy_s": full_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default=None, help="the GGUF (default: the PyPI package's, assembled)")
    a = parser.parse_args()
    from kvserve.models.loaders.gguf_file import GGUFFile
    path = gemma_file(a.model)
    meta, read_s = timed(lambda: GGUFFile(path).metadata)
    runs = [one_run(meta) for _ in range(a.runs)]
    result = {"model": Path(path).name, "runs": a.runs, "read_metadata_s": read_s,
              **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
    for k, v in result.items():
        print(f"{k:>16}: {v:.3f}" if isinstance(v, float) else f"{k:>16}: {v}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
