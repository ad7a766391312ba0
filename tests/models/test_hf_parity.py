"""Logits equal Hugging Face transformers' on random-weight models and on SmolLM2 (from the
same GGUF file), both for a full forward pass and for cached decoding step by step."""

import pytest
import torch

from kvserve.attention.backend import AttentionMetadata, PrefillSpan
from kvserve.attention.layer import ForwardContext, install
from kvserve.attention.torch_backend import TorchAttentionBackend
from tests.conftest import greedy, make_engine, run_collecting_logits

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "llama-mha": dict(kind="llama", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "llama-gqa": dict(kind="llama", num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    "llama-mqa": dict(kind="llama", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "llama-tied": dict(kind="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                       rope_theta=500000.0),
    "qwen2-bias": dict(kind="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                       rope_theta=1000000.0),
}


def build_hf(tmp_path, kind, **kw):
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, **kw)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, use_sliding_window=False, **kw)
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # biases start at zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def full_logits(model, ids, window=None):
    """One pass over the whole sequence, no cache, through the torch backend (sliding layers in
    group 1 with their window, full ones in group 0)."""
    T = len(ids)
    backend = TorchAttentionBackend(16, torch.float32)
    install(model, backend, [int(k == "sliding") for k in model.config.layer_kinds])
    metas = [backend.build_metadata(AttentionMetadata(prefills=[PrefillSpan(0, T, T)], sliding_window=w), None)
             for w in (None, window)]
    hidden = model(torch.tensor(ids), torch.arange(T), ForwardContext(None, metas))
    return model.compute_logits(hidden)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_weights_match_transformers(tmp_path, name):
    from kvserve.models.registry import build_model, load_weights
    spec = dict(CONFIGS[name])
    hf = build_hf(tmp_path, spec.pop("kind"), **spec)
    loaded = load_weights(str(tmp_path))
    assert loaded.config.num_key_value_heads == spec["num_key_value_heads"]
    ours = build_model(loaded, torch.float32, "cpu", 256)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (full_logits(ours, ids) - ref).abs().max().item() < 1e-4

    # and decoding through the paged cache, step by step, against HF's own full recompute
    engine = make_engine(loaded, block_size=4, num_blocks=64)
    (out,), logits = run_collecting_logits(engine, [ids[:13]], greedy(12))
    seq = ids[:13] + out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    steps = torch.stack(list(logits.values())[0])
    assert (steps - ref[12:12 + len(steps)]).abs().max().item() < 1e-4


@pytest.mark.slow
def test_smollm2_matches_transformers_from_the_same_gguf(smollm2, smollm2_path):
    import os
    from kvserve.models.registry import build_model
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32)
    hf.eval()
    ours = build_model(smollm2, torch.float32, "cpu", 512)
    ids = smollm2.tokenizer.encode("The KV cache keeps keys and values of every processed token so that")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    diff = (full_logits(ours, ids) - ref).abs().max().item()
    print("max abs logit diff vs transformers:", diff)
    assert diff < 1e-4, diff
    assert torch.equal(full_logits(ours, ids).argmax(-1), ref.argmax(-1))
