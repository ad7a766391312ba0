"""Products with GGUF weights kept packed, at Gemma-3-270M's FFN down shape (W [640, 2048]: the
Q4_K tensors of its Q4_K_M file; the K = 640 ones are Q5_0 / Q8_0 there, 640 not being a multiple
of 256): each type through the fp32-activation kernel and the int8-activation one, for 1 row
(decode) and 64 (a prefill chunk), beside Q4_0 (linear_quant / linear_q8) and the dense fp32
product. Figures: microseconds a call (median of the timed calls) and GB/s of weight bytes read.

    .venv/bin/python benchmarks/kquant_products.py [--threads N] [--reps 200]

Writes benchmarks/results/kquant_products.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import kernels  # noqa: E402
from kvserve.models.packed import FORMATS, PackedLinear, PackedLinearQ8, PackedLinearQ8Rows, quantize  # noqa: E402
from tests.kernels.kquant_blocks import random_packed  # noqa: E402

N, K = 640, 2048
TYPES = ["q4_k", "q6_k", "q5_k", "q3_k", "q2_k", "q5_0", "q5_1", "iq4_nl"]


def median_us(fn: Callable[[], torch.Tensor], reps: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def row(name: str, path: str, linear: torch.nn.Module, nbytes: int, reps: int) -> dict:
    out: dict = {"type": name, "path": path, "weight_bytes": nbytes}
    for m in (1, 64):
        x = torch.randn(m, K)
        with torch.no_grad():
            us = median_us(lambda: linear(x), reps)
        out[f"us_rows{m}"] = round(us, 1)
        out[f"gbs_rows{m}"] = round(nbytes / us / 1e3, 2)
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=200)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for name in TYPES:
        packed = random_packed(N, K, name)
        rows.append(row(name, "fp32 x", PackedLinear(packed), packed.data.numel(), a.reps))
        rows.append(row(name, "int8 x", PackedLinearQ8Rows(PackedLinear(packed)), packed.data.numel(), a.reps))
    w = torch.randn(N, K) * 0.02
    q4 = quantize(w, FORMATS["q4_0"])
    rows.append(row("q4_0", "fp32 x", PackedLinear(q4), q4.data.numel(), a.reps))
    rows.append(row("q4_0", "int8 x", PackedLinearQ8(PackedLinear(q4)), q4.data.numel(), a.reps))
    dense = torch.nn.Linear(K, N, bias=False)
    rows.append(row("f32", "dense", dense, N * K * 4, a.reps))
    print()
    print(f"W [{N}, {K}], {a.threads} threads, {kernels.summary(loaded_only=True)}")
    print("| type | activations | 1 row us | GB/s | 64 rows us | GB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['type']} | {r['path']} | {r['us_rows1']} | {r['gbs_rows1']} | {r['us_rows64']} | {r['gbs_rows64']} |")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "kquant_products.json")
    with open(out, "w") as f:
        json.dump({"shape": [N, K], "threads": a.threads, "kernels": kernels.summary(loaded_only=True),
                   "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
