"""Decode speed of a mixture-of-experts model next to a dense model with the same active
parameters: what a token reads, and how fast the engine decodes it.

The MoE model: 8 layers, hidden 768, 16 experts of width 768 per layer, 2 chosen per token
(the grouped expert path, kvserve.models.moe). The dense model: the same attention and a dense
MLP of width 2 x 768, so a token multiplies by as many weights in both; the MoE model holds 8x
the MLP weights but a decode step reads only the chosen experts'. Random weights (seed 0), fp32,
batch 1 and 8, prompts of 32 tokens, 64 greedy tokens each; tok/s counts decode steps only.
The machine is shared: figures are noisy, compare them within one run.

    .venv/bin/python benchmarks/moe_decode.py [--threads N]

Writes benchmarks/results/moe_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

HIDDEN, LAYERS, EXPERTS, TOP_K, EXPERT_WIDTH = 768, 8, 16, 2, 768
PROMPT, NEW_TOKENS = 32, 64


def configs():
    from kvserve.config import ModelConfig, MoEConfig
    common = dict(vocab_size=4096, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=12,
                  num_key_value_heads=4, max_position_embeddings=512)
    moe = ModelConfig(intermediate_size=EXPERT_WIDTH, name="random-moe", architecture="mixtral",
                      moe=MoEConfig(EXPERTS, TOP_K, EXPERT_WIDTH), **common)
    dense = ModelConfig(intermediate_size=TOP_K * EXPERT_WIDTH, name="random-dense", **common)
    return moe, dense


def random_loaded(config):
    """Random weights (normal, std 0.02; norms 1) in kvserve's names."""
    import torch
    from kvserve.models.loaders.base import LoadedModel
    from kvserve.models.llama import LlamaForCausalLM
    from kvserve.models.registry import MODEL_CLASSES
    torch.manual_seed(0)
    with torch.device("meta"):
        model = MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)(config)
    sd = {k: (torch.ones(v.shape) if "norm" in k else torch.randn(v.shape) * 0.02)
          for k, v in model.state_dict().items()}
    return LoadedModel(config, sd, None, config.name)


def decode_rate(loaded, batch: int) -> float:
    """Decode tokens per second at this batch (prefill steps not counted)."""
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_options("bench", loaded=loaded, num_blocks=batch * 8 + 8, max_num_seqs=batch,
                                    max_model_len=PROMPT + NEW_TOKENS + 16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i in range(batch):
        engine.add_request(None, [(i * 31 + j * 7) % 4000 + 1 for j in range(PROMPT)], params)
    engine.step()  # the prefills
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps * batch / (time.perf_counter() - start)


def main() -> None:
    import torch
    from kvserve.kv.sizing import weight_params
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    for config in configs():
        count = weight_params(config)
        loaded = random_loaded(config)
        row = {"params": count.total, "params_per_token": count.per_token, "weight_bytes": count.total * 4,
               "weight_bytes_per_token": count.per_token * 4}
        for batch in (1, 8):
            row[f"decode_tok_s_batch{batch}"] = round(decode_rate(loaded, batch), 1)
        results[config.name] = row
        print(f"{config.name}: {count.total / 1e6:.0f}M parameters ({count.total * 4 / 2**20:.0f} MiB fp32), "
              f"a token reads {count.per_token / 1e6:.0f}M ({count.per_token * 4 / 2**20:.0f} MiB); "
              f"decode {row['decode_tok_s_batch1']} tok/s at batch 1, {row['decode_tok_s_batch8']} at batch 8")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "moe_decode.json")
    with open(out, "w") as f:
        json.dump({"threads": torch.get_num_threads(), "shape": dict(hidden=HIDDEN, layers=LAYERS, experts=EXPERTS, top_k=TOP_K,
                                 expert_width=EXPERT_WIDTH, prompt=PROMPT, new_tokens=NEW_TOKENS),
                   "results": results}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
