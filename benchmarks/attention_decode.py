"""One layer's paged decode attention on CPU: the compiled kernel (csrc/paged_attention.cpp) built
for each instruction-set level this CPU runs (AVX-512, AVX2) against the torch backend (blocks
gathered into a contiguous copy, dequantized, then SDPA), for every KV cache format.

Shapes (query heads / K/V heads x head dim): SmolLM2-135M 9/3 x 64, a Llama-like 8B 32/8 x 128,
Gemma-3-270M 4/1 x 256. Each sequence's context fills shuffled blocks of 16 tokens. Reported per
(shape, format, batch, context, threads): the median time of one call in ms; every level's
output is checked against torch (1e-4) before it is timed.

    .venv/bin/python benchmarks/attention_decode.py [--shapes smollm2 gemma3] [--formats float32 int4]
        [--batches 1 4 16] [--contexts 256 2048 8192] [--threads 1 2] [--layers 30]
        [--out results/attention_decode.json]

With --layers N each timed call reads the next of N layers' caches (a decode step's order), so a
batch whose N caches outgrow the CPU's caches is timed reading from memory; with one layer it is
read from wherever the last call left it.

Writes benchmarks/results/attention_decode.json (or --out, relative to benchmarks/). On a shared
machine the timings are noisy: compare levels within one run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from typing import Any, Callable

import torch

from kvserve import kernels
from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.cpu_kernel import decode_kernel
from kvserve.attention.torch_backend import TorchAttentionBackend
from kvserve.kv.storage import KVStorage, make_storage

BLOCK = 16
SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128), "gemma3": (4, 1, 256)}  # (H, KVH, D)
FORMATS = {"float32": "dense", "bfloat16": "dense", "float16": "dense", "int8": "int8", "fp8_e4m3": "fp8",
           "fp8_e5m2": "fp8", "int4": "int4"}
SAMPLES = 5
SAMPLE_SECONDS = 0.01  # a sample repeats a fast call until it lasts this long


def filled(fmt: str, kvh: int, d: int, batch: int, context: int) -> tuple[KVStorage, torch.Tensor, torch.Tensor]:
    """A one-layer storage of format `fmt` holding `batch` contexts of `context` random tokens in
    shuffled blocks, and their block tables and lengths."""
    per = -(-context // BLOCK)
    nb = batch * per + 1
    storage = make_storage(FORMATS[fmt], fmt, [0], nb, BLOCK, kvh, d, torch.float32, "cpu", num_residual_slots=batch)
    g = torch.Generator().manual_seed(0)
    if FORMATS[fmt] == "fp8":
        storage.set_scales(torch.rand(1, 2, kvh, generator=g) * 0.02 + 0.01)
    tables = torch.randperm(nb - 1, generator=g).view(batch, per)
    for b in range(batch):  # one sequence at a time: the random rows stay small
        slots = (tables[b].unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).reshape(-1)[:context]
        storage.begin_step()
        k, v = torch.randn(context, kvh, d, generator=g) * 2, torch.randn(context, kvh, d, generator=g)
        storage.write(0, k, v, storage.plan_writes(slots))
    return storage, tables, torch.full((batch,), context)


def median_ms(fn: Callable[[], Any]) -> float:
    """The median time of one call: SAMPLES samples, each repeating the call enough times to last
    SAMPLE_SECONDS (a slow call once)."""
    start = time.perf_counter()
    fn()
    calls = max(1, int(SAMPLE_SECONDS / max(time.perf_counter() - start, 1e-7)))
    times = []
    for _ in range(SAMPLES):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return 1e3 * statistics.median(times)


def cycling(calls: list[Callable[[], Any]]) -> Callable[[], Any]:
    """One call of the list each time, in turn."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def measure(shape: str, fmt: str, batch: int, context: int, threads: list[int], layers: int = 1) -> list[dict[str, Any]]:
    """One row per thread count: torch's time and each kernel level's, in ms a call. With
    `layers` > 1 the calls go through that many layers' storages in turn, as a decode step does,
    so that each reads its cache from memory rather than from the CPU's caches."""
    H, KVH, D = SHAPES[shape]
    filled_layers = [filled(fmt, KVH, D, batch, context) for _ in range(layers)]
    storage, tables, lens = filled_layers[0]
    q = torch.randn(batch, H, D, generator=torch.Generator().manual_seed(1))
    scale = D ** -0.5
    backend = TorchAttentionBackend(BLOCK, torch.float32)
    metas = [backend.build_metadata(AttentionMetadata(num_decode_tokens=batch, decode_block_tables=t,
                                                      decode_context_lens=n, decode_max_context=context), None)
             for _, t, n in filled_layers]
    ref = backend.decode(0, q, storage, metas[0], scale)
    calls: dict[str, Callable[[], Any]] = {"torch": cycling([
        lambda s=s, m=m: backend.decode(0, q, s, m, scale) for (s, _, _), m in zip(filled_layers, metas)])}
    for isa in reversed(kernels.supported_isas("paged_attention")):
        module = kernels.load("paged_attention", isa)
        if isa == "portable" or module is None:
            continue
        kernel = decode_kernel(module, storage)
        error = (kernel(q, *storage.decode_operands(0), tables, lens, scale, 0) - ref).abs().max().item()
        assert error < 1e-4, f"{isa} differs from torch by {error} ({shape} {fmt} batch {batch} context {context})"
        calls[isa] = cycling([lambda kernel=kernel, ops=s.decode_operands(0), t=t, n=n: kernel(q, *ops, t, n, scale, 0)
                              for s, t, n in filled_layers])
    rows = []
    before = torch.get_num_threads()
    try:
        for n in threads:
            torch.set_num_threads(n)
            rows.append({"shape": shape, "format": fmt, "batch": batch, "context": context, "threads": n,
                         "layers": layers,
                         **{f"{name}_ms": round(median_ms(call), 4) for name, call in calls.items()}})
    finally:
        torch.set_num_threads(before)
    return rows


def report(row: dict[str, Any]) -> str:
    levels = "  ".join(f"{k[:-3]} {v:8.3f} ms ({row['torch_ms'] / v:5.1f}x)" for k, v in row.items()
                       if k.endswith("_ms") and k != "torch_ms")
    return (f"{row['shape']:>8} {row['format']:>8} batch {row['batch']:>2} context {row['context']:>5} "
            f"threads {row['threads']}: torch {row['torch_ms']:8.3f} ms  {levels}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=1,
                        help="go through this many layers' caches in turn (30: SmolLM2's decode step, read from memory)")
    parser.add_argument("--out", default=os.path.join("results", "attention_decode.json"))
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        for fmt in args.formats:
            for batch in args.batches:
                for context in args.contexts:
                    for row in measure(shape, fmt, batch, context, args.threads, args.layers):
                        print(report(row), flush=True)
                        rows.append(row)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), args.out)
    with open(out, "w") as f:
        shapes = {name: dict(zip(("heads", "kv_heads", "head_dim"), s)) for name, s in SHAPES.items()}
        json.dump({"torch": torch.__version__, "block_size": BLOCK, "shapes": shapes,
                   "levels": kernels.supported_isas("paged_attention"), "rows": rows}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
