"""Which product path packed GGUF weights should take, by the number of activation rows: the
measurement behind kvserve.models.products.ProductPolicy.

For the products of one decoder layer (the fused q/k/v, o, the fused gate/up and down, as the
engine builds them from the file) of SmolLM2-135M Q4_1 (kvserve's default model) and Gemma-3-270M
Q4_K_M, and for rows 1, 4, 16, 64, 256 and 512 of fp32 activations, each path's time:

    int8    PackedLinearQ8 / PackedLinearQ8Rows: activations quantized to 8 bits a block, integer dots
    float   PackedLinear: the fp32-activation kernel up to 8 rows, beyond it the weight dequantized
            to fp32 on every call and the dense GEMM
    bf16    a bf16 copy of the dequantized weight kept once, reordered for oneDNN (AMX / AVX512-BF16
            where the CPU has them), the fp32 activations converted to bf16 and the product back
    fp32    the same with an fp32 copy (oneDNN fp32)
    tiles   (Q4_0 / Q4_1 / Q8_0 with linear_q8's AMX build) the bf16 copy's product made in AMX
            tiles from the packed weight at each call, no copy held
    vnni    (the same, where the amx build runs) int8 through linear_q8's avx512_vnni build: the
            int8 path as it was without AMX-INT8

And, with `--step-rows`, one decode step's products of the whole default model as the engine
holds them (every layer's DenseAbove), made in tiles or by int8 at those rows: where the policy's
tiles threshold (tiles_above_rows) comes from.

Figures: microseconds for the layer's products (the fastest of interleaved repeats), and the bytes
each copy holds beside the packed weights. By default one thread and the process's CPU time
(`--clock cpu`): on a machine shared with other work, wall-clock times of 2 threads measure the
neighbours more than the products; `--clock wall --threads N` on a quiet machine. Timings are per
machine: compare the paths of one run.

And the engine's own speed on the default GGUF with --dtype float32 against bfloat16 (the rest
the defaults), decoding at batch 1 and 64: whether bf16 activations pay around packed kernels
that take fp32 (kvserve.config.resolve_dtype keeps float32 for packed weights).

    .venv/bin/python benchmarks/product_paths.py [--threads N] [--reps 30] [--gemma PATH]
        [--step-rows 16 24 32 48 64]

Writes benchmarks/results/product_paths.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import kernels  # noqa: E402
from kvserve.models.packed import FusedPacked, PackedLinear, PackedLinearQ8, PackedLinearQ8Rows, PackedWeight  # noqa: E402
from kvserve.models.products import DenseAbove, bf16_tiles  # noqa: E402
from kvserve.models.registry import build_model, default_model_path, load_weights  # noqa: E402

ROWS = (1, 4, 16, 32, 64, 256, 512)
PATHS = ("int8", "float", "bf16", "fp32", "tiles", "vnni")


def layer_linears(path: str) -> list[PackedLinear]:
    """Layer 0's packed products as the engine builds them (q/k/v and gate/up fused)."""
    loaded = load_weights(path)
    model = build_model(loaded, torch.float32, "cpu", 512, packed_activations="float")
    layer = model.model.layers[0]
    found = []
    for m in layer.modules():
        if isinstance(m, FusedPacked):
            found.append(m.fused)
        elif type(m) is PackedLinear and not any(m is f.fused for f in layer.modules() if isinstance(f, FusedPacked)):
            found.append(m)
    return found


class DenseCopy:
    """A dequantized copy of a packed weight in `dtype`, reordered once for oneDNN."""

    def __init__(self, linear: PackedLinear, dtype: torch.dtype) -> None:
        w = PackedWeight(linear.fmt, linear.qweight, (linear.out_features, linear.in_features)).dequantize().to(dtype)
        self.dtype, self.n, self.bytes = dtype, linear.out_features, w.numel() * w.element_size()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, 64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.weight, None, "none", [], "").float()


def paths_of(linear: PackedLinear) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each path's product for this weight (tiles only where built for its format)."""
    q8 = PackedLinearQ8(linear) if linear.fmt.name in PackedLinearQ8.FORMATS else PackedLinearQ8Rows(linear)
    paths = {"int8": q8, "float": linear, "bf16": DenseCopy(linear, torch.bfloat16),
             "fp32": DenseCopy(linear, torch.float32)}
    tiles = bf16_tiles(q8, "bfloat16")
    if tiles is not None:
        paths["tiles"] = lambda x: tiles(x, q8.qweight, q8.fmt.ggml_type, q8.in_features, q8.out_features, q8.bias)
        vnni = PackedLinearQ8(linear)
        vnni.q8 = kernels.load("linear_q8", "avx512_vnni")  # the same panels, the level below AMX
        paths["vnni"] = vnni
    return paths


def step_products(rows_list: list[int], reps: int) -> dict:
    """One decode step's products of the default model (every DenseAbove the engine holds), in
    AMX tiles against int8, ms (medians of interleaved repeats, wall time)."""
    from kvserve.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_options("SmolLM2-135M-Instruct", max_model_len=256)
    dense = [m for m in engine.model.modules() if isinstance(m, DenseAbove) and m.tiles is not None]
    if not dense:
        return {"not run": "no AMX build of linear_q8 here"}
    result: dict = {"products": len(dense), "ms": {}}
    with torch.no_grad():
        for rows in rows_list:
            xs = [torch.randn(rows, m.in_features) for m in dense]
            runs = {"tiles": lambda: [m._dense(x) for m, x in zip(dense, xs)],
                    "int8": lambda: [m.packed.forward(x) for m, x in zip(dense, xs)]}
            times: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(reps):
                for k, run in runs.items():
                    t0 = time.perf_counter()
                    run()
                    times[k].append(time.perf_counter() - t0)
            result["ms"][rows] = {k: round(statistics.median(t) * 1e3, 2) for k, t in times.items()}
            print(f"one step's {len(dense)} products at {rows} rows: " +
                  ", ".join(f"{k} {v} ms" for k, v in result["ms"][rows].items()), flush=True)
    return result


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def measure(linears: list[PackedLinear], reps: int, clock: Callable[[], float] = time.process_time) -> dict:
    per_linear = [paths_of(lin) for lin in linears]
    packed_bytes = sum(lin.qweight.numel() for lin in linears)
    result: dict = {"products": [f"{lin.fmt.name} [{lin.out_features}, {lin.in_features}]" for lin in linears],
                    "packed_bytes": packed_bytes,
                    "copy_bytes": {p: sum(pl[p].bytes for pl in per_linear) for p in ("bf16", "fp32")},
                    "us": {}}
    for rows in ROWS:
        xs = [torch.randn(rows, lin.in_features) for lin in linears]
        paths = [p for p in PATHS if all(p in pl for pl in per_linear)]
        times: dict[str, list[float]] = {p: [] for p in paths}
        with torch.no_grad():
            for p in paths:  # warm up
                for pl, x in zip(per_linear, xs):
                    pl[p](x)
            for _ in range(reps):  # interleaved, so a noisy neighbour hits every path alike
                for p in paths:
                    t0 = clock()
                    for pl, x in zip(per_linear, xs):
                        pl[p](x)
                    times[p].append(clock() - t0)
        result["us"][rows] = {p: round(min(t) * 1e6, 1) for p, t in times.items()}
        result.setdefault("median_us", {})[rows] = {p: round(statistics.median(t) * 1e6, 1) for p, t in times.items()}
    return result


def engine_speed(path: str, dtype: str, batch: int, max_tokens: int, repeats: int,
                 clock: Callable[[], float] = time.process_time) -> float:
    """Generated tokens a second of `clock` (the best of `repeats` runs) of `batch` prompts
    decoding `max_tokens` tokens each, the defaults but --dtype."""
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm_engine import LLMEngine
    loaded = load_weights(path)
    engine = LLMEngine.from_options("preloaded", loaded=loaded, dtype=dtype, max_model_len=256, max_num_seqs=batch)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    best = 0.0
    for _ in range(repeats):
        for i in range(batch):
            engine.add_request(None, f"Request {i}: tell me about the sea and the ships on it.", params)
        t0 = clock()
        while engine.has_unfinished():
            engine.step()
        best = max(best, batch * max_tokens / (clock() - t0))
    return best


def dtype_speeds(path: str, repeats: int, clock: Callable[[], float]) -> dict:
    speeds: dict = {}
    for batch, max_tokens in ((1, 64), (64, 32)):
        for dtype in ("float32", "bfloat16"):
            speeds[f"batch {batch} {dtype}"] = round(engine_speed(path, dtype, batch, max_tokens, repeats, clock), 1)
    return speeds


def gemma_path(given: str | None) -> str | None:
    if given:
        return given
    from benchmarks.gemma_gguf import gemma_file
    try:
        return gemma_file(None)
    except SystemExit as e:
        print(f"Gemma-3-270M skipped: {e}")
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=tuple(CLOCKS), default="cpu", help="cpu: the process's CPU time; wall: elapsed")
    p.add_argument("--no-engine", action="store_true", help="skip the engine's float32 vs bfloat16 speeds")
    p.add_argument("--no-products", action="store_true", help="only the engine's speeds")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--step-rows", type=int, nargs="*", default=[], help="also one decode step's products at these "
                   "rows: AMX tiles against int8 (the tiles threshold)")
    p.add_argument("--gemma", default=None, help="the Gemma-3-270M Q4_K_M GGUF (default: assembled from its package)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "product_paths.json"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    models = {"SmolLM2-135M Q4_1": default_model_path(), "Gemma-3-270M Q4_K_M": gemma_path(a.gemma)}
    report = {"cpu": platform.processor() or platform.machine(), "threads": a.threads, "reps": a.reps, "clock": a.clock,
              "bf16_flags": sorted(kernels.cpu_flags() & {"avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni"}),
              "kernels": kernels.summary(), "models": {}}
    if not a.no_engine:
        report["engine_tokens_per_s"] = speeds = dtype_speeds(models["SmolLM2-135M Q4_1"], 2, CLOCKS[a.clock])
        print("SmolLM2 Q4_1, the defaults but --dtype, generated tokens/s: "
              + ", ".join(f"{k} {v}" for k, v in speeds.items()))
    if a.step_rows:
        report["step_products"] = step_products(a.step_rows, max(5, a.reps // 2))
    for name, path in models.items():
        if path is None or a.no_products:
            continue
        r = measure(layer_linears(path), a.reps, CLOCKS[a.clock])
        report["models"][name] = r
        print(f"\n{name}: one layer's products {', '.join(r['products'])}; packed {r['packed_bytes'] / 1e6:.2f} MB, "
              f"bf16 copy {r['copy_bytes']['bf16'] / 1e6:.2f} MB, fp32 copy {r['copy_bytes']['fp32'] / 1e6:.2f} MB")
        paths = list(next(iter(r["us"].values())))
        print(f"{'rows':>6} " + " ".join(f"{p + ' us':>10}" for p in paths) + "   fastest")
        for rows, us in r["us"].items():
            best = min(us, key=us.get)
            print(f"{rows:>6} " + " ".join(f"{us[p]:>10.1f}" for p in paths) + f"   {best}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    if a.no_products and os.path.exists(a.out):  # keep the products a full run measured
        with open(a.out) as f:
            report = {**json.load(f), "engine_tokens_per_s": report.get("engine_tokens_per_s"), "clock": a.clock}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwritten: {a.out}")


if __name__ == "__main__":
    main()
