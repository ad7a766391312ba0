"""MLA decode attention over the latent cache: the CPU kernel reading the rows in place
(csrc/mla_attention.cpp, at each level this CPU runs) against the torch backend (rows gathered
into a contiguous copy, then SDPA), on DeepSeek-V2-Lite's attention shapes (16 heads,
kv_lora_rank 512, qk_rope_head_dim 64) for one layer.

Reported per (format, batch, context): the median time of one layer's decode call and the
speed-up over torch; the outputs are checked equal (1e-5) before timing.

    .venv/bin/python benchmarks/mla_kernel.py [--contexts 512 2048] [--batches 1 8] [--threads 1] [--repeats 20]

Writes benchmarks/results/mla_kernel.json. On a shared machine the timings are noisy.
"""

from __future__ import annotations

import argparse
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
from kvserve.kv.latent import make_latent_storage

HEADS, RANK, ROPE, BLOCK = 16, 512, 64, 16
FORMATS = {"float32": "dense", "bfloat16": "dense", "int8": "int8"}


def filled(fmt: str, batch: int, context: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A latent storage holding `batch` sequences of `context` random rows in shuffled blocks."""
    per = -(-context // BLOCK)
    nb = batch * per + 1
    storage = make_latent_storage(FORMATS[fmt], fmt, [0], nb, BLOCK, RANK, ROPE, "cpu")
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(nb - 1, generator=g)
    tables = order.view(batch, per)
    slots = (tables.unsqueeze(-1) * BLOCK + torch.arange(BLOCK)).reshape(batch, -1)[:, :context].reshape(-1)
    rows = torch.randn(len(slots), 1, RANK + ROPE, generator=g)
    storage.write(0, rows, rows[..., :RANK], storage.plan_writes(slots))
    return storage, tables, torch.full((batch,), context)


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(fmt: str, batch: int, context: int, repeats: int) -> dict[str, Any]:
    storage, tables, lens = filled(fmt, batch, context)
    q = torch.randn(batch, HEADS, RANK + ROPE, generator=torch.Generator().manual_seed(1))
    scale = 192 ** -0.5
    backend = TorchAttentionBackend(BLOCK, torch.float32)
    meta = backend.build_metadata(AttentionMetadata(num_decode_tokens=batch, decode_block_tables=tables,
                                                    decode_context_lens=lens, decode_max_context=context), None)
    ref = backend.decode(0, q, storage, meta, scale)
    row: dict[str, Any] = {"format": fmt, "batch": batch, "context": context,
                           "torch_ms": 1e3 * median_seconds(lambda: backend.decode(0, q, storage, meta, scale), repeats)}
    for isa in kernels.supported_isas("mla_attention"):
        module = kernels.load("mla_attention", isa)
        if module is None:
            continue
        kernel, operands = decode_kernel(module, storage), storage.decode_operands(0)
        out = kernel(q, *operands, tables, lens, scale, 0)
        assert (out - ref).abs().max().item() < 1e-5, f"{isa} differs from torch"
        row[f"{isa}_ms"] = 1e3 * median_seconds(lambda: kernel(q, *operands, tables, lens, scale, 0), repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(fmt, b, c, args.repeats) for fmt in FORMATS for b in args.batches for c in args.contexts]
    for r in rows:
        levels = "  ".join(f"{k[:-3]} {v:.2f} ms ({r['torch_ms'] / v:.1f}x)" for k, v in r.items()
                           if k.endswith("_ms") and k != "torch_ms")
        print(f"{r['format']:>8} batch {r['batch']:>2} context {r['context']:>5}: torch {r['torch_ms']:.2f} ms  {levels}")
    out = os.path.join(os.path.dirname(__file__), "results", "mla_kernel.json")
    with open(out, "w") as f:
        json.dump({"threads": args.threads, "shape": {"heads": HEADS, "kv_lora_rank": RANK, "rope": ROPE,
                                                      "block_size": BLOCK}, "rows": rows}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
