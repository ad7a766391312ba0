"""How near the default model's packed products come to streaming their weights at the machine's
read bandwidth, for the few rows of decode.

SmolLM2-135M-Instruct (the default GGUF: Q4_1 projections, the tied Q8_0 head) reads about
92 MiB of weights a decode step: 30 layers of fused qkv [960 x 576], o [576 x 576], fused
gate_up [3072 x 576] and down [576 x 1536], then the head [49152 x 576]. This script measures

  * the read bandwidth: a torch sum over 1 GiB of fp32 (and over a model-sized 92 MiB), on 1 and
    2 threads, best of the repeats;
  * each product of the model at 1, 2, 4 and 8 rows of x, on 1 and 2 threads, through both
    compiled kernels (linear_quant: float activations; linear_q8: activations quantized to 8 bits
    a block) at the best level this CPU runs: microseconds a call, GB/s of weight streamed and the
    fraction of the 1 GiB bandwidth. A pass is a decode step's products in the step's order
    (layer by layer qkv, o, gate_up, down, then the head), each call timed: every call reads
    weights last read a whole pass (92 MiB) before, more than any L3 here holds, as a decode step
    reads them. (Passes of one product over its 30 layers, repeated, read qkv's 10 MB, o's 6 MB
    and down's 17 MB from a 32 MiB L3 after the first: on the Zen 4 machine qkv streamed 46.6
    GB/s where a torch sum read 30.1, and a step's products summed to 2.70 ms; in the step's order
    they took 3.8 ms in two runs.);
  * the products of a whole decode step: one pass's wall time (30 layers and the head);
  * batch-1 greedy decode tokens/s of the engine, 128 tokens, with packed activations int8 and
    float, and the share of the engine's step (int8) its products alone take (the pass above, 1
    row, the most threads; measured minutes apart).

The kernels are timed by turns within each repeat and each figure's best repeat kept (a
product's mean call and a whole pass each on its own: they may come from different repeats): the
cores may be shared, and the fastest is what the machine allowed. A pass's time includes its
calls' timers, a few hundred nanoseconds a call (about 1% of a step).

    .venv/bin/python benchmarks/product_bandwidth.py [--threads 1 2] [--rows 1 2 4 8] [--reps 7]
    .venv/bin/python benchmarks/product_bandwidth.py --cold-hot --threads 2 --reps 9

Writes benchmarks/results/product_bandwidth.json.

`--against DIR` instead compares this tree's linear_q8 with another build of it (DIR: a copy of
kvserve/kernels/built saved before a change): passes of a decode step's products through the
two by turns, the order swapped every pair (`--pairs`), on the same inputs (the same panels, or
each build's own where the two lay W out differently); per product and for the pass, each
build's median and the median of the pairs' ratios, and whether the two builds' outputs are
equal. Pairs a few milliseconds apart share the machine's hour, which whole runs minutes apart
do not. Writes benchmarks/results/product_bandwidth_against.json.

`--cold-hot` instead times linear_q8 at 1 row on the most threads: each call of a step's pass
(from memory), the same call again at once (from the caches) and a torch sum over the same bytes
(from memory), a call over one cached panel, and a line through the layer products' times from
memory against their bytes (its intercept: a call's fixed cost; its slope: the streaming rate).
Writes benchmarks/results/product_cold_hot.json.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvserve import kernels  # noqa: E402
from kvserve.bench.machine import machine_kind, parse_cpuinfo  # noqa: E402
from kvserve.kernels import levels  # noqa: E402
from kvserve.models.loaders.gguf_file import GGUFFile  # noqa: E402
from kvserve.models.registry import default_model_path  # noqa: E402

RESULT = Path(__file__).parent / "results" / "product_bandwidth.json"
AGAINST_RESULT = Path(__file__).parent / "results" / "product_bandwidth_against.json"
COLD_HOT = Path(__file__).parent / "results" / "product_cold_hot.json"
# the model's products: the GGUF tensors each fuses (rows stacked), per layer
LAYER_PRODUCTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
                  "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}
KERNELS = ("linear_quant", "linear_q8")


class Product:
    """One product of the model: its GGUF type, shape and the weights of every layer it has."""

    def __init__(self, name: str, ggml_type: int, n: int, k: int, weights: list[torch.Tensor]) -> None:
        self.name, self.ggml_type, self.n, self.k, self.weights = name, ggml_type, n, k, weights

    @property
    def bytes_per_call(self) -> int:
        return self.weights[0].numel()


def model_products(path: str) -> list[Product]:
    """The default model's products, each with its GGUF rows [N, row bytes] per layer."""
    f = GGUFFile(path)
    by_name = {t.name: t for t in f.tensors}

    def rows(name: str) -> torch.Tensor:
        t = by_name[name]
        return torch.frombuffer(bytearray(f.data[t.offset:t.offset + t.nbytes]), dtype=torch.uint8).reshape(t.shape[0], -1)

    layers = sum(1 for name in by_name if name.endswith(".attn_q.weight"))
    products = []
    for product, parts in LAYER_PRODUCTS.items():
        first = [by_name[f"blk.0.{p}.weight"] for p in parts]
        assert len({t.ggml_type for t in first}) == 1, f"{product}: parts of different types"
        weights = [torch.cat([rows(f"blk.{i}.{p}.weight") for p in parts]).contiguous() for i in range(layers)]
        products.append(Product(product, first[0].ggml_type, sum(t.shape[0] for t in first), first[0].shape[1], weights))
    head = by_name.get("output.weight", by_name["token_embd.weight"])  # tied: the embedding's table
    products.append(Product("head", head.ggml_type, head.shape[0], head.shape[1], [rows(head.name).contiguous()]))
    return products


def read_bandwidth(mib: int, reps: int) -> float:
    """GB/s of a torch sum over `mib` MiB of fp32, best of `reps`."""
    x = torch.ones(mib * (1 << 20) // 4)
    x.sum()
    return x.numel() * 4 / min(_seconds(lambda: x.sum()) for _ in range(reps)) / 1e9


def _seconds(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def step_calls(kernel_name: str, module: Any, products: list[Product], xs: dict[int, torch.Tensor],
               packed: Optional[dict[int, torch.Tensor]] = None) -> list[tuple[str, Callable[[], Any]]]:
    """A decode step's products in its order through a kernel (its weights in that kernel's
    layout): each layer's products in turn, then the head; (product, call) pairs. linear_q8's
    panels are kept in `packed` (by the GGUF rows' id) where given, and taken from it when there."""
    def call(p: Product, w: torch.Tensor) -> Callable[[], Any]:
        x = xs[p.k]
        if kernel_name == "linear_q8":
            panels = packed.get(id(w)) if packed is not None else None
            if panels is None:
                panels = module.pack_panels(w, p.ggml_type, p.k)
                if packed is not None:
                    packed[id(w)] = panels
            return lambda: module.linear_q8(x, panels, p.ggml_type, p.k, p.n, None)
        return lambda: module.linear_quant(x, w, p.ggml_type, p.k, None)

    layers = max(len(p.weights) for p in products)
    each_layer = [p for p in products if len(p.weights) == layers]
    after = [p for p in products if len(p.weights) != layers]  # the head
    return ([(p.name, call(p, p.weights[i])) for i in range(layers) for p in each_layer]
            + [(p.name, call(p, w)) for p in after for w in p.weights])


def time_products(products: list[Product], modules: dict[str, Any], rows: int, reps: int
                  ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Microseconds a call of each (kernel, product), its mean over a pass, and microseconds a
    pass (a decode step's products): the best pass of `reps`, kernels by turns."""
    g = torch.Generator().manual_seed(0)
    xs = {p.k: torch.randn(rows, p.k, generator=g) for p in products}
    passes = {k: step_calls(k, m, products, xs) for k, m in modules.items()}
    calls_of = {p.name: len(p.weights) for p in products}
    best: dict[str, dict[str, float]] = {k: {} for k in modules}
    step: dict[str, float] = {}
    for calls in passes.values():
        for _, fn in calls:
            fn()  # warm-up
    for _ in range(reps):
        for k, calls in passes.items():
            spent = dict.fromkeys(calls_of, 0.0)
            start = time.perf_counter()
            for name, fn in calls:
                t = time.perf_counter()
                fn()
                spent[name] += time.perf_counter() - t
            step[k] = min(step.get(k, float("inf")), (time.perf_counter() - start) * 1e6)
            for name, s in spent.items():
                best[k][name] = min(best[k].get(name, float("inf")), s / calls_of[name] * 1e6)
    return best, step


def product_table(products: list[Product], modules: dict[str, Any], threads: list[int], rows: list[int], reps: int,
                  bandwidth: dict[int, float]) -> list[dict[str, Any]]:
    entries = []
    for t in threads:
        torch.set_num_threads(t)
        for m in rows:
            us, pass_us = time_products(products, modules, m, reps)
            for k in modules:
                for p in products:
                    gb_s = p.bytes_per_call / us[k][p.name] / 1e3
                    entries.append({"threads": t, "rows": m, "kernel": k, "product": p.name, "us": round(us[k][p.name], 2),
                                    "gb_s": round(gb_s, 2), "of_bandwidth": round(gb_s / bandwidth[t], 3)})
                step_us = pass_us[k]
                step_bytes = sum(p.bytes_per_call * len(p.weights) for p in products)
                gb_s = step_bytes / step_us / 1e3
                entries.append({"threads": t, "rows": m, "kernel": k, "product": "decode step", "us": round(step_us, 1),
                                "gb_s": round(gb_s, 2), "of_bandwidth": round(gb_s / bandwidth[t], 3)})
                print(f"{t} thread(s), {m} row(s), {k:12s} " + "  ".join(
                    f"{e['product']} {e['us']:.1f} us {e['gb_s']:.1f} GB/s ({e['of_bandwidth']:.0%})"
                    for e in entries if e["threads"] == t and e["rows"] == m and e["kernel"] == k), flush=True)
    return entries


def decode_tokens_per_s(threads: int, tokens: int, repeats: int) -> dict[str, float]:
    """Batch-1 greedy decode tokens/s of the engine, packed activations int8 and float: median of
    `repeats` runs of `tokens` decode steps."""
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.models.registry import load_weights
    torch.set_num_threads(threads)
    loaded = load_weights(default_model_path())
    out = {}
    for acts in ("int8", "float"):
        engine = LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded, max_model_len=1024, num_blocks=128,
                                        enable_prefix_caching=False, packed_activations=acts)
        runs = []
        for r in range(repeats + 1):  # the first warms up
            engine.add_request(f"r{r}", [1], SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True))
            engine.step()  # the 1-token prompt, then `tokens` decode steps
            t = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            runs.append(tokens / (time.perf_counter() - t))
        out[acts] = round(statistics.median(runs[1:]), 1)
        engine.close()
        print(f"decode, batch 1, {threads} threads, packed activations {acts}: {out[acts]} tokens/s", flush=True)
    return out


def build_in(directory: str, name: str) -> Any:
    """Kernel `name`'s module at this CPU's best level from another build's directory, loaded
    beside this tree's (a module of the same name from another file)."""
    module = levels.module_name(name, kernels.best_isa(name))
    found = sorted(Path(directory).glob(f"{module}.*.so"))
    if not found:
        raise SystemExit(f"--against {directory}: no {module}.*.so there")
    loader = importlib.machinery.ExtensionFileLoader(module, str(found[0]))
    spec = importlib.util.spec_from_loader(module, loader)
    built = importlib.util.module_from_spec(spec)
    loader.exec_module(built)
    return built


def paired_passes(products: list[Product], builds: dict[str, Any], rows: int, pairs: int,
                  alike: bool = True) -> dict[str, Any]:
    """Passes of a decode step's products through each build of linear_q8 by turns (the order
    swapped every pair): each build's median microseconds and the median of the pairs' ratios
    (the second build over the first), per product and for the pass."""
    g = torch.Generator().manual_seed(0)
    xs = {p.k: torch.randn(rows, p.k, generator=g) for p in products}
    # the same panels for both where the builds lay W out alike (two copies of the weights could
    # lie on pages of unequal cost, which would weigh on one build's every pass); else each its own
    shared: dict[int, torch.Tensor] = {}
    passes = {k: step_calls("linear_q8", m, products, xs, shared if alike else None) for k, m in builds.items()}
    first, second = builds
    equal = all(torch.equal(f(), h()) for (_, f), (_, h) in zip(passes[first], passes[second]))
    spent: dict[str, dict[str, list[float]]] = {k: {} for k in builds}
    for i in range(pairs):
        for k in (builds if i % 2 == 0 else list(builds)[::-1]):
            per: dict[str, float] = {}
            start = time.perf_counter()
            for name, fn in passes[k]:
                t = time.perf_counter()
                fn()
                per[name] = per.get(name, 0.0) + time.perf_counter() - t
            per["pass"] = time.perf_counter() - start
            for name, s in per.items():
                spent[k].setdefault(name, []).append(s * 1e6)
    return {"rows": rows, "outputs_equal": equal,
            "parts": {name: paired_figures(first, spent[first][name], second, spent[second][name])
                      for name in spent[first]}}


def paired_figures(first: str, a: list[float], second: str, b: list[float]) -> dict[str, float]:
    """Two builds' microseconds, pair by pair: each one's median and the median of b / a."""
    return {first: round(statistics.median(a), 1), second: round(statistics.median(b), 1),
            "ratio": round(statistics.median(y / x for x, y in zip(a, b)), 4)}


def against(directory: str, threads: list[int], rows: list[int], pairs: int) -> None:
    builds = {"other": build_in(directory, "linear_q8"), "this": kernels.load("linear_q8")}
    if builds["this"] is None:
        raise SystemExit(f"linear_q8 is not built here ({kernels.failure('linear_q8')})")
    products = model_products(default_model_path())
    # one weight of each format: where the two builds lay W out alike, they read the same panels
    alike = all(torch.equal(*(m.pack_panels(p.weights[0], p.ggml_type, p.k) for m in builds.values()))
                for p in {p.ggml_type: p for p in products}.values())
    if not alike:
        print("the two builds lay out W's panels differently: each reads its own", flush=True)
    runs = []
    for t in threads:
        torch.set_num_threads(t)
        for r in rows:
            run = {"threads": t, **paired_passes(products, builds, r, pairs, alike)}
            runs.append(run)
            parts = run["parts"]
            whole = parts["pass"]
            each = ", ".join(f"{n} {v['ratio']:.3f}" for n, v in parts.items() if n != "pass")
            equal = "equal" if run["outputs_equal"] else "DIFFER"
            print(f"{t} thread(s), {r} row(s): a pass {whole['other']:.0f} us there, {whole['this']:.0f} "
                  f"here: paired ratio {whole['ratio']:.3f} ({each}); outputs {equal}", flush=True)
    AGAINST_RESULT.parent.mkdir(parents=True, exist_ok=True)
    machine = machine_kind(parse_cpuinfo(Path("/proc/cpuinfo").read_text()))
    stored = {"model": "SmolLM2-135M-Instruct Q4_1 GGUF (Q8_0 head)", "machine": machine,
              "level": builds["this"].isa(), "other": Path(directory).name, "pairs": pairs,
              "panels": "the same" if alike else "each build's own layout", "runs": runs}
    AGAINST_RESULT.write_text(json.dumps(stored, indent=1) + "\n")
    print(f"wrote {AGAINST_RESULT}")


def cold_and_hot(products: list[Product], module: Any, threads: int, reps: int) -> dict[str, Any]:
    """linear_q8 at 1 row: each call of a decode step's products in the step's order (its weights
    last read a pass, 92 MiB, before: from memory) and the same call again at once (from the
    caches), and in a pass of its own a torch sum over each call's weight bytes in the same
    order (from memory), medians over `reps` passes; a call over one panel (16 W rows, cached: the
    call's own cost; padded to a pair of panels since the panels went in pairs, so runs stored
    before that read half the bytes); and line_through's line of the layer products' times from
    memory over their bytes."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    xs = {p.k: torch.randn(1, p.k, generator=g) for p in products}
    packed: dict[int, torch.Tensor] = {}
    calls = step_calls("linear_q8", module, products, xs, packed=packed)
    # the same bytes in the same order, read by a torch sum (packed in the pass's order, each once)
    reads = [(name, panels.view(torch.float32).sum) for (name, _), panels in zip(calls, packed.values())]
    cold: dict[str, list[float]] = {}
    hot: dict[str, list[float]] = {}
    read: dict[str, list[float]] = {}
    for _ in range(reps):
        for name, fn in calls:
            first = _seconds(fn)
            cold.setdefault(name, []).append(first)
            hot.setdefault(name, []).append(_seconds(fn))
        for name, fn in reads:
            read.setdefault(name, []).append(_seconds(fn))
    small = products[0]
    panel = module.pack_panels(small.weights[0][:16].contiguous(), small.ggml_type, small.k)
    x = xs[small.k]

    def one_call() -> None:
        module.linear_q8(x, panel, small.ggml_type, small.k, 16, None)

    one_panel = statistics.median(_seconds(one_call) for _ in range(2000)) * 1e6
    rows, from_memory = [], {}
    for p in products:
        c, h, r = (statistics.median(t[p.name]) * 1e6 for t in (cold, hot, read))
        nbytes = p.bytes_per_call
        from_memory[p.name] = (nbytes, c)
        rows.append({"product": p.name, "bytes": nbytes, "cold_us": round(c, 2), "hot_us": round(h, 2),
                     "sum_us": round(r, 2), "cold_gb_s": round(nbytes / c / 1e3, 1),
                     "hot_gb_s": round(nbytes / h / 1e3, 1)})
        print(f"{p.name:8} {nbytes / 1e3:8.1f} KB  from memory {c:7.1f} us ({nbytes / c / 1e3:5.1f} GB/s)"
              f"  again at once {h:7.1f} us ({nbytes / h / 1e3:5.1f} GB/s)  a torch sum of its bytes "
              f"from memory {r:7.1f} us")
    fit = {**line_through([v for k, v in from_memory.items() if k != "head"]),
           "one_panel_call_us": round(one_panel, 2)}
    print(f"layer products from memory: {fit['fixed_us']:.2f} us a call + bytes at "
          f"{fit['streaming_gb_s']:.1f} GB/s; a call over one cached panel {one_panel:.2f} us "
          f"({threads} threads)")
    return {"threads": threads, "passes": reps, "products": rows, "fit": fit}


def line_through(points: list[tuple[int, float]]) -> dict[str, float]:
    """The least-squares line through (bytes, microseconds) points: its slope as GB/s streamed
    and its intercept as a call's fixed microseconds. line_through([(0, 1.0), (1000, 2.0)]) ==
    {"streaming_gb_s": 1.0, "fixed_us": 1.0}"""
    mb = statistics.fmean(b for b, _ in points)
    mt = statistics.fmean(t for _, t in points)
    slope = sum((b - mb) * (t - mt) for b, t in points) / sum((b - mb) ** 2 for b, _ in points)
    return {"streaming_gb_s": round(1 / slope / 1e3, 1), "fixed_us": round(mt - slope * mb, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--decode-repeats", type=int, default=3)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--against", metavar="DIR", help="compare linear_q8 with the build in DIR (see above)")
    p.add_argument("--pairs", type=int, default=30, help="pairs of passes for --against")
    mode.add_argument("--cold-hot", action="store_true", help="linear_q8 at 1 row, each call from memory and "
                      "again at once (see cold_and_hot), on the most threads; writes " + COLD_HOT.name)
    a = p.parse_args()
    if a.against:
        against(a.against, a.threads, a.rows, a.pairs)
        return
    modules = {k: kernels.load(k) for k in (("linear_q8",) if a.cold_hot else KERNELS)}
    missing = [k for k, m in modules.items() if m is None]
    if missing:
        raise SystemExit(f"compiled kernels missing: {', '.join(f'{k} ({kernels.failure(k)})' for k in missing)}")
    if a.cold_hot:
        got = cold_and_hot(model_products(default_model_path()), modules["linear_q8"], max(a.threads), a.reps)
        machine = machine_kind(parse_cpuinfo(Path("/proc/cpuinfo").read_text()))
        COLD_HOT.write_text(json.dumps({"model": "SmolLM2-135M-Instruct Q4_1 GGUF (Q8_0 head)",
                                        "machine": machine, "level": modules["linear_q8"].isa(), **got},
                                       indent=1) + "\n")
        print(f"wrote {COLD_HOT}")
        return
    bandwidth, model_sized = {}, {}
    for t in a.threads:
        torch.set_num_threads(t)
        bandwidth[t], model_sized[t] = read_bandwidth(1024, a.reps), read_bandwidth(92, a.reps)
        print(f"read bandwidth, {t} thread(s): {bandwidth[t]:.1f} GB/s over 1 GiB, {model_sized[t]:.1f} over 92 MiB")
    products = model_products(default_model_path())
    table = product_table(products, modules, a.threads, a.rows, a.reps, bandwidth)
    decode = decode_tokens_per_s(max(a.threads), a.decode_tokens, a.decode_repeats)
    share = None
    if 1 in a.rows:
        # the step's products alone against the engine's step, at the same threads (minutes apart)
        products_us = next(e["us"] for e in table if e["threads"] == max(a.threads) and e["rows"] == 1
                           and e["kernel"] == "linear_q8" and e["product"] == "decode step")
        step_us = 1e6 / decode["int8"]
        print(f"batch-1 decode step of the engine (int8 activations) {step_us:.0f} us; its products alone, "
              f"in its order, {products_us:.0f} us ({products_us / step_us:.0%} of the step)")
        share = {"step_us": round(step_us, 1), "products_us": products_us,
                 "of_step": round(products_us / step_us, 3)}
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (Q8_0 head)",
        "levels": {k: m.isa() for k, m in modules.items()},
        "read_gb_s": {"1GiB": bandwidth, "92MiB": model_sized},
        "products": [{"product": p.name, "ggml_type": p.ggml_type, "n": p.n, "k": p.k, "layers": len(p.weights),
                      "bytes": p.bytes_per_call} for p in products],
        "timings": table,
        "decode_batch1_tokens_per_s": {"threads": max(a.threads), **decode},
        "step_products_share": share,
    }, indent=1) + "\n")
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
