"""What per-group freeing saves on a hybrid model: a Gemma-3-style config at SmolLM2's scale
(30 layers, 9 query and 3 KV heads of 64, hidden 576; five local layers with a 1,024-token
window to every global one; random bf16 weights), sequences of 8,192 tokens.

For the cache as built (a sliding-window group gives back the blocks its window has passed) and
with that freeing turned off (every group keeps every block, attention unchanged), one row:
KV bytes one 8,192-token sequence holds (counted from the blocks it holds after its context is
filled), how many such sequences a 1 GiB cache admits, and decode tok/s at batch 1 and at that
batch. Contexts are filled with random K/V through the cache's own write path (as in
kv_quant.py); the timed steps are real engine steps. Medians of the timed steps.

    .venv/bin/python benchmarks/bounded_cache.py [--steps 8]

Writes benchmarks/results/bounded_cache.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kv_quant import decode_tok_s, fill_contexts  # noqa: E402

from kvserve.core import cache_group  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.models.registry import load_weights  # noqa: E402

CONTEXT, WINDOW, BUDGET = 8192, 1024, 1 << 30
RESULTS = Path(__file__).parent / "results" / "bounded_cache.json"


def gemma3_like(path: str):  # type: ignore[no-untyped-def]
    import transformers
    config = transformers.Gemma3TextConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=CONTEXT + 256, sliding_window=WINDOW,
        sliding_window_pattern=6, query_pre_attn_scalar=64, rope_local_base_freq=10000.0, rope_theta=1_000_000.0)
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return load_weights(path)


@contextmanager
def without_freeing() -> Iterator[None]:
    """Window groups keep every block (and admission counts them all); attention is unchanged."""
    saved = (cache_group.SlidingWindowGroup.remove_skipped_blocks, cache_group.CacheGroupSpec.max_blocks_held)
    cache_group.SlidingWindowGroup.remove_skipped_blocks = cache_group.CacheGroup.remove_skipped_blocks
    cache_group.CacheGroupSpec.max_blocks_held = lambda self, n, bs, step=1: -(-n // bs)  # type: ignore
    try:
        yield
    finally:
        cache_group.SlidingWindowGroup.remove_skipped_blocks, cache_group.CacheGroupSpec.max_blocks_held = saved


def measure(loaded, steps: int) -> dict:  # type: ignore[no-untyped-def]
    def engine(batch: int, **opts) -> LLMEngine:  # type: ignore[no-untyped-def]
        return LLMEngine.from_options("gemma3-like", loaded=loaded, dtype="bfloat16", max_model_len=CONTEXT + 128,
                                      max_num_seqs=batch, max_num_batched_tokens=1024, **opts)
    probe = engine(256, kv_cache_memory=BUDGET)
    # decoding sequences hold their window's blocks; one step's tokens more are shared by all
    steady = probe.kv.blocks_needed(CONTEXT + 64, 1)
    fits = (probe.plan.num_blocks - (probe.kv.blocks_needed(CONTEXT + 64) - steady)) // steady
    fill_contexts(probe, 1, CONTEXT)
    held = probe.kv.num_held_blocks("0") * probe.plan.block_bytes
    del probe
    row = {"sequence_bytes": held, "fit_in_1_GiB": fits}
    for batch in sorted({1, fits}):
        e = engine(batch, kv_cache_memory=BUDGET)
        fill_contexts(e, batch, CONTEXT)
        row[f"decode_tok_s_batch_{batch}"] = decode_tok_s(e, batch, steps)
        del e
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        loaded = gemma3_like(d)
    kinds = loaded.config.layer_kinds
    rows = {"per-group freeing": measure(loaded, a.steps)}
    with without_freeing():
        rows["every block kept"] = measure(loaded, a.steps)
    print(f"Gemma-3-style, SmolLM2 scale ({kinds.count('sliding')} local layers, window {WINDOW}, "
          f"{kinds.count('full')} global), bf16, {CONTEXT:,}-token sequences, {torch.get_num_threads()} threads")
    print(f"{'':>18} | {'KV per sequence':>15} | {'fit in 1 GiB':>12} | decode tok/s")
    for name, r in rows.items():
        speeds = ", ".join(f"batch {k.rsplit('_', 1)[1]}: {v:.1f}" for k, v in r.items() if k.startswith("decode"))
        print(f"{name:>18} | {r['sequence_bytes'] / 2**20:>11.1f} MiB | {r['fit_in_1_GiB']:>12} | {speeds}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"context": CONTEXT, "window": WINDOW, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
