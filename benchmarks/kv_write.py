"""One decode step's cache write: `layer_ops.store_kv` putting a batch's new K/V rows into their
slots, one call a layer, when the slots lie in blocks anywhere in a cache far larger than the
CPU's caches (a batch of sequences that grew apart, as in offline throughput).

SmolLM2-135M's shapes (3 K/V heads of 64, 30 layers), 1,024 blocks of 16 a layer (fp32: 755 MB
of cache in all, bf16 half that), a batch's slots in random blocks, a new random set each step.
Median microseconds a layer call over 40 steps.

    .venv/bin/python benchmarks/kv_write.py [--batch 64] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve import kernels

LAYERS, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM = 30, 1024, 16, 3, 64


def write_us(batch: int, dtype: torch.dtype, steps: int = 40) -> float:
    """The median time of one layer's store_kv of `batch` tokens, microseconds."""
    ops = kernels.load("layer_ops")
    caches = [(torch.zeros(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype),
               torch.zeros(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)) for _ in range(LAYERS)]
    k, v = (torch.randn(batch, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))
    times = []
    for step in range(steps):
        slots = torch.randperm(BLOCKS)[:batch] * BLOCK + step % BLOCK
        start = time.perf_counter()
        for kc, vc in caches:
            ops.store_kv(kc, vc, slots, k, v)
        times.append((time.perf_counter() - start) / LAYERS * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    a = p.parse_args()
    if kernels.load("layer_ops") is None:
        raise SystemExit(f"layer_ops is not built here: {kernels.failure('layer_ops')}")
    for name in a.dtypes:
        print(f"store_kv, {a.batch} tokens in random blocks, {name}: {write_us(a.batch, getattr(torch, name)):.1f} us a layer")


if __name__ == "__main__":
    main()
