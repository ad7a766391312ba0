"""What LoRA rows cost a decode batch: decode tok/s of 32 sequences on a small random Llama
(hidden 512, 8 layers, 8 query and 4 KV heads, random fp32 weights) with adapters of rank 16 on
all seven projections (PEFT, random weights), for

    off       LoRA not enabled (nothing wrapped: the engine as it is without adapters)
    0         LoRA enabled, 4 adapters loaded, every row on the base model
    1         every row on one adapter
    4         rows spread over four adapters (8 each)

Each run prefills its 32 prompts, then times `--steps` decode steps (every step decodes all 32
rows; median of three timings). The machine is shared: figures are noisy.

    .venv/bin/python benchmarks/lora_batch.py [--steps 16]

Writes benchmarks/results/lora_batch.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.models.registry import load_weights

BATCH, PROMPT_LEN, RANK = 32, 16, 16
RESULTS = Path(__file__).parent / "results" / "lora_batch.json"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(root: Path):  # type: ignore[no-untyped-def]
    """The base model (a Hugging Face directory) and four adapter directories."""
    import peft
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    base = transformers.LlamaForCausalLM(config).eval()
    base.save_pretrained(root / "base", safe_serialization=True)
    for i in range(4):
        torch.manual_seed(i + 1)
        lora = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False)
        peft.get_peft_model(copy.deepcopy(base), lora).save_pretrained(root / f"a{i}")
    return load_weights(str(root / "base"))


def decode_tok_s(engine: LLMEngine, adapters: list[Optional[str]], steps: int) -> float:
    """Prefill BATCH prompts (adapter of row i: adapters[i % len]), then time `steps` steps."""
    g = torch.Generator().manual_seed(0)
    for i in range(BATCH):
        prompt = torch.randint(0, 4096, (PROMPT_LEN,), generator=g).tolist()
        params = SamplingParams(temperature=0, max_tokens=4 * steps + 8, ignore_eos=True,
                                lora_request=adapters[i % len(adapters)])
        engine.add_request(None, prompt, params)
    engine.step()  # every prompt in one step (BATCH * PROMPT_LEN tokens)
    timings = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        timings.append(time.perf_counter() - t0)
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    return BATCH * steps / statistics.median(timings)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=16)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        loaded = build(root)
        common = dict(max_num_seqs=BATCH, num_blocks=512, block_size=16)
        off = LLMEngine.from_options("base", loaded=loaded, **common)
        row = {"off": decode_tok_s(off, [None], a.steps)}
        del off
        engine = LLMEngine.from_options("base", loaded=loaded, lora_modules=[f"a{i}={root / f'a{i}'}" for i in range(4)],
                                        **common)
        for name, adapters in (("0", [None]), ("1", ["a0"]), ("4", ["a0", "a1", "a2", "a3"])):
            row[name] = decode_tok_s(engine, adapters, a.steps)
    print(f"decode tok/s, batch {BATCH}, rank {RANK} on all 7 projections, hidden 512 x 8 layers (fp32, CPU):")
    for name, value in row.items():
        label = "LoRA off" if name == "off" else f"{name} adapter(s) in the batch"
        print(f"  {label:28s} {value:8.1f}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"batch": BATCH, "rank": RANK, "steps": a.steps, "decode_tok_s": row}, indent=2) + "\n")


if __name__ == "__main__":
    main()
