"""MLA's latent cache against the same model with its latents expanded to per-head K/V.

A DeepSeek-V2-Lite-shaped random model scaled down to what this machine holds: the attention
shapes kept (16 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim
128, no query compression), fewer layers, a narrower residual stream and a dense MLP. Reported:

  - KV bytes per token and per sequence, and sequences of that context that fit in 1 GiB, for
    the latent cache (layers x (512 + 64) values) and for per-head K/V (layers x heads x (192 +
    128) values, an MHA cache of the same heads); also for DeepSeek-V2-Lite's real 27 layers.
    The expanded engine's dense storage pads V to the key's width (192): its allocated bytes are
    listed too.
  - decode tok/s of both through the engine (the same weights, the torch attention path): a
    batch of requests with random prompts is prefilled, then engine steps where every request
    decodes are timed (median step), tokens per second = batch / median step.

    .venv/bin/python benchmarks/mla_cache.py [--layers 6] [--batch 4] [--prompt 256] [--steps 16] [--threads 1]

Writes benchmarks/results/mla_cache.json. On a shared machine the timings are noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from kvserve.config import MLAConfig, ModelConfig
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.kv.formats import kv_format, mha_bytes_per_token
from kvserve.models.deepseek import DeepseekForCausalLM
from kvserve.models.loaders.base import LoadedModel
from kvserve.models.registry import KNOWN_CONFIGS

GIB = 1 << 30
HEADS, RANK, ROPE, NOPE, V = 16, 512, 64, 128, 128


def bench_config(layers: int, hidden: int) -> ModelConfig:
    return ModelConfig(4096, hidden, 2816, layers, HEADS, HEADS, NOPE + ROPE, 4096, 1e-6, name="v2-lite-shaped",
                       architecture="deepseek_v2", mla=MLAConfig(RANK, NOPE, ROPE, V))


def random_model(config: ModelConfig, seed: int = 0) -> LoadedModel:
    torch.manual_seed(seed)
    model = DeepseekForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return LoadedModel(config, {k: v.detach().clone() for k, v in model.state_dict().items()}, None, "bench:mla")


def expanded(loaded: LoadedModel) -> LoadedModel:
    mla = dataclasses.replace(loaded.config.mla, cache_form="expanded")
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, mla=mla))


def cache_figures(config: ModelConfig, dtype: str, context: int) -> dict[str, float]:
    fmt = kv_format(dtype)
    latent = fmt.bytes_per_token(config)
    per_head = mha_bytes_per_token(fmt, config)
    padded = fmt.bytes_per_token(expanded(LoadedModel(config, {}, None, "")).config)
    return {"latent_bytes_per_token": latent, "expanded_bytes_per_token": per_head,
            "expanded_padded_bytes_per_token": padded, "ratio": per_head / latent,
            "latent_bytes_per_sequence": latent * context, "expanded_bytes_per_sequence": per_head * context,
            "latent_sequences_in_1gib": GIB // int(latent * context),
            "expanded_sequences_in_1gib": GIB // int(per_head * context)}


def decode_tok_s(loaded: LoadedModel, batch: int, prompt: int, steps: int) -> dict[str, float]:
    engine = LLMEngine.from_options("bench", loaded=loaded, max_model_len=prompt + steps + 8, max_num_seqs=batch,
                                    max_num_batched_tokens=batch * prompt, block_size=16,
                                    num_blocks=batch * ((prompt + steps + 8) // 16 + 2), attention_backend="torch")
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(None, torch.randint(0, loaded.config.vocab_size, (prompt,), generator=g).tolist(), params)
    t0 = time.perf_counter()
    while engine.num_generated_tokens < batch:  # every prompt prefilled, its first token sampled
        engine.step()
    prefill_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    median = statistics.median(times)
    return {"prefill_s": prefill_s, "median_step_s": median, "tok_s": batch / median,
            "cache_bytes": engine.storage.nbytes, "block_bytes": engine.storage.bytes_per_block}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096, help="the context the bytes per sequence are for")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default torch's); 1 keeps a shared, loaded machine from stalling "
                         "threads that wait on each other")
    a = ap.parse_args()
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    config = bench_config(a.layers, a.hidden)
    loaded = random_model(config)
    result = {"config": {"layers": a.layers, "hidden": a.hidden, "heads": HEADS, "kv_lora_rank": RANK,
                         "qk_rope_head_dim": ROPE, "qk_nope_head_dim": NOPE, "v_head_dim": V, "mlp": "dense 2816"},
              "batch": a.batch, "prompt": a.prompt, "context": a.context, "threads": torch.get_num_threads(),
              "bench_model_fp32": cache_figures(config, "float32", a.context),
              "deepseek_v2_lite_bf16": cache_figures(KNOWN_CONFIGS["deepseek-v2-lite"], "bfloat16", a.context)}
    for name, model in (("latent", loaded), ("expanded", expanded(loaded))):
        result[f"decode_{name}"] = decode_tok_s(model, a.batch, a.prompt, a.steps)
    for key in ("bench_model_fp32", "deepseek_v2_lite_bf16"):
        r = result[key]
        print(f"{key}: {r['latent_bytes_per_token']:,.0f} B/token latent vs {r['expanded_bytes_per_token']:,.0f} "
              f"per-head K/V ({r['ratio']:.1f}x); context {a.context}: {r['latent_sequences_in_1gib']} vs "
              f"{r['expanded_sequences_in_1gib']} sequences in 1 GiB")
    for name in ("latent", "expanded"):
        d = result[f"decode_{name}"]
        print(f"decode {name}: {d['tok_s']:.1f} tok/s (batch {a.batch}, context ~{a.prompt}; median step "
              f"{d['median_step_s'] * 1e3:.1f} ms; cache {d['cache_bytes'] / 2**20:.1f} MiB, "
              f"{d['block_bytes']:,} B/block)")
    out = os.path.join(os.path.dirname(__file__), "results", "mla_cache.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print("wrote", out)


if __name__ == "__main__":
    main()
