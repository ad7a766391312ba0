"""Int8-activation products with GGUF weights kept packed (kernels/csrc/linear_kquant.cpp's
linear_q8: every K-quant, Q5_0, Q5_1 and IQ4_NL), beside linear_q8.cpp's Q4_0 panels on the same
shape, for 1, 4, 16, 128 and 512 rows of x on 1 and 2 threads.

Shapes: W [640, 2048] (Gemma-3-270M's FFN down, a Q4_K / Q6_K tensor of its Q4_K_M file) for
every type, and W [2048, 640] (its gate / up: Q5_0 there, 640 not being a multiple of 256) for the
32-weight types. Figures a (type, shape, rows, threads): microseconds a call (median of the timed
calls), GB/s of weight bytes read a call (the streaming figure for a few rows), and the ratio of
the call's time to Q4_0's on the same shape, rows and threads (1.0: as fast as Q4_0). The
products compared (Q4_0, the installed build, and `--compare`'s build if given) take turns call
by call, so a machine whose load changes slows them alike and the ratios hold.

    .venv/bin/python benchmarks/kquant_products.py [--label after] [--threads 1 2] [--seconds 0.3]
        [--compare path/to/linear_kquant_<level>.so]

Results go under `--label` in benchmarks/results/kquant_products.json (other labels kept).
`--compare` names another build of linear_kquant.cpp (an earlier revision's, built beside the
checkout) to time against the installed one; its figures go under "<label>/compare".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import kernels  # noqa: E402
from kvserve.models.packed import FORMATS, PackedLinear, PackedLinearQ8, PackedLinearQ8Rows, quantize  # noqa: E402
from tests.kernels.kquant_blocks import random_packed  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "kquant_products.json")
ROWS = (1, 4, 16, 128, 512)
K_QUANTS = ["q4_k", "q6_k", "q5_k", "q3_k", "q2_k"]
SMALL = ["q5_0", "q5_1", "iq4_nl"]
SHAPES = {(640, 2048): K_QUANTS + SMALL, (2048, 640): SMALL}


def median_us(fns: list[Callable[[], Any]], seconds: float) -> list[float]:
    """The median time of each function's calls, the functions taking turns for about `seconds`
    (at least 5 calls each), after 2 untimed calls each."""
    for fn in fns:
        fn()
        fn()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < 5 or time.perf_counter() - start < seconds:
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e6 for t in times]


def load_build(path: str) -> Any:
    """A built linear_kquant module from its file (an extension module is named by its file)."""
    spec = importlib.util.spec_from_file_location(os.path.basename(path).split(".")[0], path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--compare: {path} is not a loadable module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if os.path.realpath(module.__file__) != os.path.realpath(path):  # a module of that name was loaded already
        raise SystemExit(f"--compare: {path} loads as {module.__file__}; give the build a file name of its own")
    return module


def products(name: str, n: int, k: int, compare: Optional[Any]) -> tuple[int, list[Callable[[torch.Tensor], Any]]]:
    """Q4_0's product, the installed build's and the compared build's (if any) on W [n, k], and
    the packed weight's bytes."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.02
    q4_0 = PackedLinearQ8(PackedLinear(quantize(w, FORMATS["q4_0"])))
    packed = random_packed(n, k, name)
    fns: list[Callable[[torch.Tensor], Any]] = [q4_0, PackedLinearQ8Rows(PackedLinear(packed))]
    if compare is not None:
        fns.append(lambda x: compare.linear_q8(x, packed.data, packed.fmt.ggml_type, k, None))
    return packed.data.numel(), fns


def figures(name: str, shape: tuple[int, int], threads: int, m: int, nbytes: int, us: float, q4_0: float) -> dict:
    return {"type": name, "shape": list(shape), "threads": threads, "rows": m, "us": round(us, 1),
            "gbs": round(nbytes / us / 1e3, 2), "q4_0_us": round(q4_0, 1), "vs_q4_0": round(us / q4_0, 2)}


def measure(threads: int, seconds: float, compare: Optional[Any]) -> tuple[list[dict], list[dict]]:
    """Every (type, shape, rows) on `threads`: the installed build's figures, and the compared one's."""
    torch.set_num_threads(threads)
    rows, compared = [], []
    g = torch.Generator().manual_seed(0)
    for (n, k), types in SHAPES.items():
        for name in types:
            nbytes, fns = products(name, n, k, compare)
            for m in ROWS:
                x = torch.randn(m, k, generator=g)
                with torch.no_grad():
                    us = median_us([lambda fn=fn: fn(x) for fn in fns], seconds)
                rows.append(figures(name, (n, k), threads, m, nbytes, us[1], us[0]))
                line = rows[-1]
                if compare is not None:
                    compared.append(figures(name, (n, k), threads, m, nbytes, us[2], us[0]))
                    line = {**line, "compare_us": compared[-1]["us"], "compare_vs_q4_0": compared[-1]["vs_q4_0"]}
                print(json.dumps(line), flush=True)
    return rows, compared


def table(rows: list[dict]) -> None:
    print("| type | W | threads | " + " | ".join(f"{m} rows: us (GB/s, x Q4_0)" for m in ROWS) + " |")
    print("|---|---|---|" + "---|" * len(ROWS))
    cells: dict[tuple, list[str]] = {}
    for r in rows:
        key = (r["type"], f"{r['shape'][0]}x{r['shape'][1]}", r["threads"])
        cells.setdefault(key, []).append(f"{r['us']} ({r['gbs']}, {r['vs_q4_0']})")
    for (name, shape, threads), c in cells.items():
        print(f"| {name} | {shape} | {threads} | " + " | ".join(c) + " |")


def save(label: str, rows: list[dict], compared: list[dict], compare: Optional[str]) -> None:
    results: dict = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            results = json.load(f)
        if "rows" in results:  # the single-run layout this file had before labels
            results = {}
    results[label] = {"kernels": kernels.summary(loaded_only=True), "loadavg": round(os.getloadavg()[0], 1),
                      "rows": rows}
    if compare is not None:
        results[f"{label}/compare"] = {"build": os.path.basename(compare), "rows": compared}
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="after", help="the key the results go under (e.g. before, after)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seconds", type=float, default=0.3, help="time spent timing each figure")
    p.add_argument("--compare", help="another build of linear_kquant (a .so file) to time beside the installed one")
    a = p.parse_args()
    compare = load_build(a.compare) if a.compare else None
    rows: list[dict] = []
    compared: list[dict] = []
    for threads in a.threads:
        r, c = measure(threads, a.seconds, compare)
        rows += r
        compared += c
    print()
    print(kernels.summary(loaded_only=True), f"; load average {os.getloadavg()[0]:.1f}")
    table(rows)
    if compare is not None:
        print(f"\n--compare {a.compare}")
        table(compared)
    save(a.label, rows, compared, a.compare)


if __name__ == "__main__":
    main()
