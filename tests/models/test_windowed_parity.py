"""Models with sliding-window layers equal Hugging Face transformers (fp32, 1e-4): random-weight
Mistral, Qwen2 with windows, Gemma 2 and Gemma 3 (text) whose window is shorter than prompt plus
output, for a full pass and for cached decoding 64 steps past the window, greedy tokens the
same; the window groups give their blocks back as the sequence grows."""

import pytest
import torch

from tests.conftest import greedy, make_engine, run_collecting_logits
from tests.models.test_hf_parity import full_logits

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, head_dim=16)
WINDOW = 8
CONFIGS = {
    "mistral": lambda: transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW),
    "qwen2-window": lambda: transformers.Qwen2Config(**COMMON, num_hidden_layers=3, use_sliding_window=True,
                                                     sliding_window=WINDOW, max_window_layers=1),
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, num_hidden_layers=4, sliding_window=WINDOW,
                                                query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
                                                final_logit_softcapping=15.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(**COMMON, num_hidden_layers=6, sliding_window=WINDOW,
                                                    query_pre_attn_scalar=24, sliding_window_pattern=3,
                                                    rope_local_base_freq=10000.0, rope_theta=1_000_000.0),
}
MODELS = {"mistral": "MistralForCausalLM", "qwen2-window": "Qwen2ForCausalLM", "gemma2": "Gemma2ForCausalLM",
          "gemma3": "Gemma3ForCausalLM"}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    from kvserve.models.registry import load_weights
    name = request.param
    path = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    hf = getattr(transformers, MODELS[name])(CONFIGS[name]()).eval()
    with torch.no_grad():  # norms and embeddings away from their initial values: make them count
        for pname, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in pname else 0.05))
    hf.save_pretrained(path, safe_serialization=True)
    return name, hf, load_weights(str(path))


def test_config_reads_the_window_layers(pair):
    name, hf, loaded = pair
    kinds = loaded.config.layer_kinds
    assert loaded.config.sliding_window == WINDOW and "sliding" in kinds
    expected = {"mistral": ("sliding",) * 2, "qwen2-window": ("full", "sliding", "sliding"),
                "gemma2": ("sliding", "full") * 2, "gemma3": ("sliding", "sliding", "full") * 2}[name]
    assert kinds == expected


def test_full_pass_equals_transformers(pair):
    name, hf, loaded = pair
    from kvserve.models.registry import build_model
    ours = build_model(loaded, torch.float32, "cpu", 512)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (full_logits(ours, ids, window=WINDOW) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("backend", ["torch", "cpu-kernel"])
def test_cached_decode_64_steps_past_the_window_equals_transformers(pair, backend):
    name, hf, loaded = pair
    if backend == "cpu-kernel":
        from tests.conftest import compiled_kernel
        compiled_kernel("paged_attention")
        if loaded.config.attn_logit_softcapping is not None:
            with pytest.raises(ValueError, match="soft-cap"):
                make_engine(loaded, attention_backend=backend)
            return
    prompt = torch.randint(0, 128, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    engine = make_engine(loaded, block_size=4, num_blocks=96, attention_backend=backend)
    (out,), logits = run_collecting_logits(engine, [prompt], greedy(64, ignore_eos=True))
    seq = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    steps = torch.stack(list(logits.values())[0])
    assert (steps - ref[len(prompt) - 1:len(prompt) - 1 + len(steps)]).abs().max().item() < 1e-4
    assert out.outputs[0].token_ids == ref[len(prompt) - 1:-1].argmax(-1).tolist()  # greedy tokens the same


def test_window_groups_hold_only_their_window(pair):
    """During a long generation every window group holds at most W tokens plus a block per
    sequence (the scheduler checks it after each step), so the request's footprint stops growing
    in them; nothing leaks; prefix caching on == off."""
    name, hf, loaded = pair
    prompt = list(range(1, 30))
    outs = {}
    for caching in (True, False):
        engine = make_engine(loaded, block_size=4, num_blocks=96, enable_prefix_caching=caching)
        engine.add_request("a", prompt, greedy(80, ignore_eos=True))
        engine.add_request("b", prompt, greedy(80, ignore_eos=True))  # shares the prompt's blocks
        done = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
            engine.scheduler.check_integrity()
            for g in engine.kv.groups:
                if g.spec.kind == "sliding":
                    for rid in g.tables:
                        assert sum(1 for _ in g.held_blocks(rid)) <= -(-(WINDOW - 1) // 4) + 1
        assert engine.kv.pool.num_used_blocks == 0
        outs[caching] = [done[r].outputs[0].token_ids for r in ("a", "b")]
    assert outs[True] == outs[False]
