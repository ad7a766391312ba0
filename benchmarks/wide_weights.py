"""An fp32 model over 16-bit weights (a GGUF's F16 / BF16 matrices): cast to fp32 at load, or kept
16-bit (models/packed.py's WIDE_FORMATS, multiplied by kernels/csrc/linear_wide.cpp).

SmolLM2-135M's shapes (hidden 576, intermediate 1536, 30 layers, the tied 49152-row head), random
weights rounded to bf16 or fp16. For each path this prints the bytes of its matrices and

  * the products of one decode step (30 layers and the head) at 1 to 64 rows of x, milliseconds,
    best pass of the repeats, every call reading another layer's weights: the fp32 cast as the
    engine runs it (q, k, v, o, gate, up, down apart, weights reordered for oneDNN) and as the
    stock F.linear runs it (q|k|v and gate|up fused), and the kept weights through PackedLinear
    (fused, as the model builds them: the kernel up to 32 rows, widen-then-GEMM above) and, at
    every row count, through each of those two alone;
  * batch-1 greedy decode tokens/s of the engine (--dtype float32), --weight-dtype float32 (the
    cast) against auto (kept 16-bit).

    .venv/bin/python benchmarks/wide_weights.py [--threads 2] [--reps 7] [--tokens 64]

Writes benchmarks/results/wide_weights.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvserve import kernels  # noqa: E402
from kvserve.models.linear import onednn_available  # noqa: E402
from kvserve.models.packed import PackedLinear, keep_wide  # noqa: E402
from kvserve.models.registry import KNOWN_CONFIGS  # noqa: E402

RESULT = Path(__file__).parent / "results" / "wide_weights.json"
CONFIG = dataclasses.replace(KNOWN_CONFIGS["smollm2-135m"], tie_word_embeddings=True)  # as published
HIDDEN, INTER, LAYERS, VOCAB = CONFIG.hidden_size, CONFIG.intermediate_size, CONFIG.num_hidden_layers, CONFIG.vocab_size
KV = CONFIG.num_key_value_heads * CONFIG.head_dim
APART = {"q": (HIDDEN, HIDDEN), "k": (KV, HIDDEN), "v": (KV, HIDDEN), "o": (HIDDEN, HIDDEN),
         "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}  # [N, K]
FUSED = {"qkv": (HIDDEN + 2 * KV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
         "down": (HIDDEN, INTER)}
HEAD = (VOCAB, HIDDEN)


def weights(shapes: dict[str, tuple[int, int]], dtype: torch.dtype, g: torch.Generator) -> list[list[torch.Tensor]]:
    """Each layer's matrices of `shapes` (and the head, last, alone), random, rounded to dtype."""
    layers = [[(torch.randn(*s, generator=g) * 0.05).to(dtype) for s in shapes.values()] for _ in range(LAYERS)]
    return layers + [[(torch.randn(*HEAD, generator=g) * 0.05).to(dtype)]]


def step_calls(products: list[list[Callable[[torch.Tensor], torch.Tensor]]], shapes: dict[str, tuple[int, int]]
               ) -> Callable[[dict[int, torch.Tensor]], None]:
    """One decode step's products; each is handed the rows of x of its K (xs: K -> [rows, K])."""
    ks = [k for _, k in shapes.values()]
    flat = [(p, ks[i] if len(layer) > 1 else HEAD[1]) for layer in products for i, p in enumerate(layer)]

    def step(xs: dict[int, torch.Tensor]) -> None:
        for p, k in flat:
            p(xs[k])
    return step


def paths(dtype: torch.dtype) -> dict[str, tuple[Callable[[dict[int, torch.Tensor]], None], int]]:
    """Each path's decode-step products and the bytes of its matrices."""
    g = torch.Generator().manual_seed(0)
    apart = [[w.float() for w in layer] for layer in weights(APART, dtype, g)]
    fused = weights(FUSED, dtype, g)
    fused32 = [[w.float() for w in layer] for layer in fused]
    out: dict[str, tuple[Callable[[dict[int, torch.Tensor]], None], int]] = {}
    if onednn_available():
        packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in layer] for layer in apart]
        out["fp32 cast, oneDNN (engine)"] = (step_calls([[
            (lambda x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")) for w in layer]
            for layer in packed], APART), _bytes(apart))
    stock = [[(lambda x, w=w: F.linear(x, w)) for w in layer] for layer in fused32]
    out["fp32 cast, F.linear"] = (step_calls(stock, FUSED), _bytes(fused32))
    linears = [[PackedLinear(keep_wide(w)) for w in layer] for layer in fused]
    out["16-bit kept, PackedLinear"] = (step_calls(linears, FUSED), _bytes(fused))
    out["16-bit kept, widen + GEMM"] = (step_calls([[
        (lambda x, m=m: F.linear(x, m._dense_weight(torch.float32))) for m in layer] for layer in linears], FUSED),
        _bytes(fused))
    kernel = kernels.load("linear_wide")
    if kernel is not None:
        out["16-bit kept, kernel alone"] = (step_calls([[
            (lambda x, m=m: kernel.linear_quant(x, m.qweight, m.fmt.ggml_type, m.in_features, None)) for m in layer]
            for layer in linears], FUSED), _bytes(fused))
    return out


def _bytes(layers: list[list[torch.Tensor]]) -> int:
    return sum(w.numel() * w.element_size() for layer in layers for w in layer)


def best_ms(step: Callable[[dict[int, torch.Tensor]], None], rows: int, reps: int) -> float:
    g = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=g) for k in (HIDDEN, INTER)}
    step(xs)  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        step(xs)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def loaded_model(dtype: torch.dtype) -> Any:
    """SmolLM2-135M's architecture with random 16-bit matrices, as a GGUF of them loads."""
    from kvserve.models.loaders.base import LoadedModel
    g = torch.Generator().manual_seed(1)
    sd = {"model.embed_tokens.weight": (torch.randn(*HEAD, generator=g) * 0.05).to(dtype),
          "model.norm.weight": torch.ones(HIDDEN)}
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
    for i in range(LAYERS):
        for short, shape in APART.items():
            sd[f"model.layers.{i}.{names[short]}.weight"] = (torch.randn(*shape, generator=g) * 0.05).to(dtype)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[f"model.layers.{i}.{norm}.weight"] = torch.ones(HIDDEN)
    return LoadedModel(CONFIG, sd, None, f"random-smollm2-{dtype}")


def decode_tokens_per_second(loaded: Any, weight_dtype: str, tokens: int) -> float:
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_options("preloaded", loaded=loaded, dtype="float32", weight_dtype=weight_dtype,
                                    num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.add_request(None, list(range(1, 9)), params)
    engine.step()  # the prompt and the first token
    t, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"{kernels.summary()}; linear_wide at {kernels.best_isa('linear_wide')}; {a.threads} threads")
    result: dict[str, Any] = {"threads": a.threads, "isa": kernels.best_isa("linear_wide"), "products_ms": {},
                              "matrix_bytes": {}, "decode_tokens_per_s": {}}
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        print(f"\n{name} weights: one decode step's products (30 layers + head), ms, best of {a.reps}")
        print(f"  {'path':30s} {'MB':>7s} " + " ".join(f"{r:>7d}" for r in a.rows))
        for path, (step, nbytes) in paths(dtype).items():
            times = [best_ms(step, r, a.reps) for r in a.rows]
            print(f"  {path:30s} {nbytes / 1e6:7.1f} " + " ".join(f"{t:7.2f}" for t in times))
            result["products_ms"][f"{name}: {path}"] = dict(zip(a.rows, times))
            result["matrix_bytes"][f"{name}: {path}"] = nbytes
        loaded = loaded_model(dtype)
        for weight_dtype, label in (("float32", "fp32 cast"), ("auto", "16-bit kept")):
            tps = decode_tokens_per_second(loaded, weight_dtype, a.tokens)
            print(f"  engine decode, batch 1, {label:12s}: {tps:7.1f} tokens/s")
            result["decode_tokens_per_s"][f"{name}: {label}"] = tps
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {RESULT}")


if __name__ == "__main__":
    main()
