"""Qwen3, Phi-3, Phi-4-mini's partial rotary, OLMo-2, SmolLM3 and Granite equal Hugging Face
transformers (fp32, logits within 1e-4, greedy tokens the same) on tiny random configs: a full
pass, and through the engine cached in small blocks, with chunked prefill and under preemption,
with prefix caching on as off (Phi-3's longrope inside its original length); each family's GGUF
(its tensor names and metadata as llama.cpp's converter writes them) loads to the same logits;
the fast path equals the eager modules bit for bit; unknown architectures and unserved RoPE
scalings are refused, naming what is supported."""

import math

import numpy as np
import pytest
import torch

from kvserve.models.loaders.base import ModelLoadError
from tests.conftest import greedy, make_engine, run_collecting_logits
from tests.models.test_hf_parity import full_logits
from tests.runner.test_fast_path import assert_same, fast_and_eager, layer_kernels_built

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=None,
              bos_token_id=None, eos_token_id=None)
FAMILIES = {
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=16)),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON)),
    "phi4-partial-rotary": lambda: transformers.Phi3ForCausalLM(
        transformers.Phi3Config(**COMMON, partial_rotary_factor=0.75)),
    "olmo2": lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**COMMON)),
    "smollm3": lambda: transformers.SmolLM3ForCausalLM(  # layer 3 without RoPE (every fourth, as published)
        transformers.SmolLM3Config(**{**COMMON, "num_hidden_layers": 4})),
    "granite": lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(
        **COMMON, embedding_multiplier=6.0, attention_multiplier=0.15, residual_multiplier=0.4, logits_scaling=3.0)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, the transformers model, kvserve's load of its saved directory)."""
    from kvserve.models.registry import load_weights
    path = tmp_path_factory.mktemp(request.param)
    hf = save_family(request.param, path)
    return request.param, hf, load_weights(str(path))


def save_family(name, path):
    """The family's tiny random transformers model, saved to path (safetensors, fp32)."""
    torch.manual_seed(0)
    hf = FAMILIES[name]().eval()
    with torch.no_grad():  # norms and embeddings away from their initial values: make them count
        for pname, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in pname else 0.05))
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def reference(hf, seq):
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0]


def prompt(n, seed):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_reads_the_family(family):
    name, hf, loaded = family
    cfg = loaded.config
    assert cfg.architecture == {"phi4-partial-rotary": "phi3"}.get(name, name)
    assert cfg.rotary_dim == (12 if name == "phi4-partial-rotary" else 16)
    assert cfg.nope_layers == ((3,) if name == "smollm3" else ())
    assert (cfg.embedding_multiplier, cfg.attention_scale) == ((6.0, 0.15) if name == "granite" else (1.0, 0.25))


def test_full_pass_and_paged_decode_equal_transformers(family):
    name, hf, loaded = family
    from kvserve.models.registry import build_model
    ids = prompt(40, 1)
    ours = build_model(loaded, torch.float32, "cpu", 512)
    assert (full_logits(ours, ids) - reference(hf, ids)).abs().max().item() < 1e-4
    engine = make_engine(loaded, block_size=4, num_blocks=64)
    (out,), logits = run_collecting_logits(engine, [ids[:13]], greedy(12, ignore_eos=True))
    seq = ids[:13] + out.outputs[0].token_ids
    ref = reference(hf, seq)[12:-1]
    assert (torch.stack(list(logits.values())[0]) - ref).abs().max().item() < 1e-4
    assert out.outputs[0].token_ids == ref.argmax(-1).tolist()


def test_chunked_prefill_under_preemption_equals_transformers(family):
    """Several prompts at once, prefilled in chunks of at most 5 tokens beside decodes, in a pool
    too small for all of them, so some are preempted and recomputed: each sequence's logits and
    tokens are transformers'."""
    name, hf, loaded = family
    engine = make_engine(loaded, block_size=4, num_blocks=14, max_num_batched_tokens=8, max_prefill_chunk=5)
    prompts = [prompt(n, 10 + n) for n in (7, 15, 11, 4)]
    outs, logits = run_collecting_logits(engine, prompts, greedy(12, ignore_eos=True))
    assert engine.stats().scheduler.num_preemptions > 0
    for p, out, rows in zip(prompts, outs, logits.values()):
        ref = reference(hf, p + out.outputs[0].token_ids)[len(p) - 1:-1]
        assert (torch.stack(rows) - ref).abs().max().item() < 1e-4
        assert out.outputs[0].token_ids == ref.argmax(-1).tolist()


def test_prefix_caching_on_equals_off(family):
    """Two requests sharing a 12-token prefix: the second reads the first's cached blocks and
    gives what it gives with no prefix caching (the same tokens, logits within 1e-4)."""
    name, hf, loaded = family
    shared = prompt(12, 7)
    prompts = [shared + prompt(3, 8), shared + prompt(5, 9)]
    runs = {}
    for caching in (True, False):
        engine = make_engine(loaded, block_size=4, enable_prefix_caching=caching)
        outs = [run_collecting_logits(engine, [p], greedy(8, ignore_eos=True)) for p in prompts]
        runs[caching] = [(o.outputs[0].token_ids, torch.stack(list(rows.values())[0])) for (o,), rows in outs]
        assert engine.kv.pool.num_used_blocks == 0
        assert (engine.stats().scheduler.prefix_hit_rate > 0) == caching
    for (tokens_on, logits_on), (tokens_off, logits_off) in zip(runs[True], runs[False]):
        assert tokens_on == tokens_off and (logits_on - logits_off).abs().max().item() < 1e-4


def test_fast_path_equals_the_eager_modules(family):
    """Bit for bit, with int8 weights: q|k|v and gate|up fused, every block's kernels bound."""
    name, hf, loaded = family
    prompts = [[(7 * i + j) % 120 + 3 for j in range(n)] for i, n in enumerate((5, 19, 11))]
    runs = fast_and_eager(loaded, prompts, max_tokens=16, weight_dtype="int8")
    assert_same(runs)
    if layer_kernels_built():
        assert any(k.endswith(".attn") for k in runs[True][1]), f"{name}: no attention layer bound"


# ---- GGUF: the same weights as llama.cpp's converter writes them ----
GGUF_NAMES = {  # HF name in a layer -> the GGUF tensor's
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}
OLMO2_NAMES = {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def permute(a, heads):
    """llama.cpp's q/k row order for its interleaved RoPE (what kvserve's loader undoes)."""
    return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def write_gguf(path, arch, hf, extra=None):
    cfg, sd = hf.config, {k: v.numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers), w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size), w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads), w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(16), w.add_value_length(16)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"]), w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2"), w.add_token_merges(["t 0"])
    w.add_token_list(["t", "0", "t0"] + [f"x{i}" for i in range(3, cfg.vocab_size)])
    if arch == "phi3":
        w.add_rope_dimension_count(int(16 * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
        if "original_max_position_embeddings" in cfg.rope_parameters:  # longrope (attention factor: default)
            w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
    if arch == "granite":
        w.add_embedding_scale(cfg.embedding_multiplier), w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier), w.add_logit_scale(cfg.logits_scaling)

    def add(name, a):
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    add("token_embd.weight", sd["model.embed_tokens.weight"]), add("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd and not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    names = {**GGUF_NAMES, **(OLMO2_NAMES if arch == "olmo2" else {})}
    for key, a in sd.items():
        if not key.startswith("model.layers."):
            continue
        i, inner = key.split(".")[2], ".".join(key.split(".")[3:-1])
        if arch in ("smollm3", "granite") and inner in ("self_attn.q_proj", "self_attn.k_proj"):
            a = permute(a, cfg.num_attention_heads if "q_proj" in inner else cfg.num_key_value_heads)
        add(f"blk.{i}.{names[inner]}.weight", a)
    for name, a in (extra or {}).items():
        add(name, a)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


def test_gguf_of_the_same_weights_equals_the_hf_load(family, tmp_path):
    from kvserve.models.registry import build_model, load_weights
    name, hf, loaded = family
    arch = loaded.config.architecture
    write_gguf(tmp_path / f"{name}.gguf", arch, hf)
    from_gguf = load_weights(str(tmp_path / f"{name}.gguf"))
    for field in ("architecture", "rotary_dim", "nope_layers", "head_dim", "tie_word_embeddings"):
        assert getattr(from_gguf.config, field) == getattr(loaded.config, field), field
    for field in ("embedding_multiplier", "attention_scale", "residual_multiplier", "logits_scaling"):  # f32 there
        assert getattr(from_gguf.config, field) == pytest.approx(getattr(loaded.config, field), rel=1e-6), field
    ids = prompt(30, 3)
    ours = full_logits(build_model(from_gguf, torch.float32, "cpu", 512), ids)
    assert (ours - reference(hf, ids)).abs().max().item() < 1e-4
    assert (ours - full_logits(build_model(loaded, torch.float32, "cpu", 512), ids)).abs().max().item() < 1e-5


# ---- what is refused, and the published configs ----
def test_unknown_architectures_are_refused_naming_the_supported(tmp_path):
    import json
    from kvserve.models.registry import read_model_config
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], **COMMON}))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \['FooForCausalLM'\].*Qwen3ForCausalLM.*"
                                             r"SmolLM3ForCausalLM"):
        read_model_config(str(tmp_path / "hf"))
    w = gguf.GGUFWriter(str(tmp_path / "foo.gguf"), "foo")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'foo'.*'qwen3'.*'phi3'.*'olmo2'.*"
                                             r"'smollm3'.*'granite'"):
        read_model_config(str(tmp_path / "foo.gguf"))


def test_phi3_longrope_equals_transformers_inside_the_original_length(tmp_path):
    """Longrope (Phi-3 128k, Phi-4-mini) with partial rotary: inside the original length (16 here)
    each cached step's logits are transformers' own; past it each position is turned by the long
    factors, as transformers turns a sequence that long (it re-encodes the whole sequence by them
    when it crosses; kvserve keeps the keys it cached, turned by the short ones)."""
    from kvserve.models.registry import build_model, load_weights
    g = torch.Generator().manual_seed(5)
    scaling = {"rope_type": "longrope", "short_factor": (1 + torch.rand(6, generator=g)).tolist(),
               "long_factor": (2 + 4 * torch.rand(6, generator=g)).tolist()}
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **{**COMMON, "max_position_embeddings": 64}, partial_rotary_factor=0.75, original_max_position_embeddings=16,
        rope_scaling=scaling)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_weights(str(tmp_path))
    assert loaded.config.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(16)))
    p = prompt(11, 4)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
        short, _ = hf.model.rotary_emb(torch.zeros(1, 1, 16), torch.arange(16)[None])
        long, _ = hf.model.rotary_emb(torch.zeros(1, 1, 16), torch.arange(40)[None])
    (out,), logits = run_collecting_logits(make_engine(loaded, block_size=4), [p], greedy(5, ignore_eos=True))
    assert out.outputs[0].token_ids == ref.sequences[0, len(p):].tolist()
    assert (torch.stack(list(logits.values())[0]) - torch.cat(ref.logits)).abs().max().item() < 1e-4
    rope = build_model(loaded, torch.float32, "cpu", 40).rope
    assert torch.allclose(rope.cos[:16], short[0, :, :6]) and torch.allclose(rope.cos[16:], long[0, 16:, :6])
    # the same from GGUF: factors as rope_factors_long / _short, the rest as metadata
    write_gguf(tmp_path / "phi3.gguf", "phi3", hf, extra={
        "rope_factors_long.weight": np.array(scaling["long_factor"]),
        "rope_factors_short.weight": np.array(scaling["short_factor"])})
    from_gguf = load_weights(str(tmp_path / "phi3.gguf"))
    for key, value in loaded.config.rope_scaling.items():
        assert from_gguf.config.rope_scaling[key] == (value if isinstance(value, str) else pytest.approx(value)), key
    ids = prompt(15, 6)
    ours = full_logits(build_model(from_gguf, torch.float32, "cpu", 64), ids)
    assert (ours - reference(hf, ids)).abs().max().item() < 1e-4


def test_rope_scalings_not_served_are_refused(tmp_path):
    """YaRN on a dense family, and a GGUF's longrope factors without their original length: refused by name."""
    import json
    from kvserve.models.registry import load_weights, read_model_config
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], **COMMON, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(ModelLoadError, match="rope scaling 'yarn' is not supported; supported: default"):
        read_model_config(str(tmp_path / "hf"))
    torch.manual_seed(0)
    hf = FAMILIES["phi3"]()
    write_gguf(tmp_path / "phi3.gguf", "phi3", hf, extra={"rope_factors_long.weight": np.ones(8, np.float32)})
    with pytest.raises(ModelLoadError, match="longrope needs tensors rope_factors_long and rope_factors_short"):
        load_weights(str(tmp_path / "phi3.gguf"))


def test_attention_sinks_are_refused_where_one_rotation_does_not_fit_every_layer(family):
    """A sink's score needs the query turned back by a distance: not one rotation for NoPE layers
    (SmolLM3) or part of a head (partial rotary)."""
    name, hf, loaded = family
    if name not in ("smollm3", "phi4-partial-rotary"):
        make_engine(loaded, sliding_window=16, attention_sinks=4)
        return
    with pytest.raises(ValueError, match="attention sinks"):
        make_engine(loaded, sliding_window=16, attention_sinks=4)


@pytest.mark.parametrize("field, value, message", [
    ("rotary_dim", 7, "rotary_dim must be an even integer in 2..head_dim"),
    ("rotary_dim", 18, "rotary_dim must be an even integer in 2..head_dim"),
    ("nope_layers", (2,), r"nope_layers must name layers in 0..1"),
    ("logits_scaling", 0.0, "logits_scaling must be a finite number > 0"),
    ("residual_multiplier", float("nan"), "residual_multiplier must be a finite number"),
])
def test_model_config_refuses_impossible_family_fields(field, value, message):
    from kvserve.config import ModelConfig
    with pytest.raises(ValueError, match=message):
        ModelConfig(128, 64, 96, 2, 4, 2, **{field: value})


@pytest.mark.parametrize("name, kv_bytes_per_token", [
    ("qwen3-8b", 2 * 36 * 8 * 128 * 2), ("phi-4-mini", 2 * 32 * 8 * 128 * 2), ("olmo-2-7b", 2 * 32 * 32 * 128 * 2),
    ("smollm3-3b", 2 * 36 * 4 * 128 * 2), ("granite-3.3-8b", 2 * 40 * 8 * 128 * 2),
])
def test_published_configs_are_known_to_kvserve_memory(name, kv_bytes_per_token, capsys):
    from kvserve.cli import main
    from kvserve.models.registry import read_model_config
    cfg = read_model_config(name)
    assert 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 == kv_bytes_per_token
    main(["memory", "--model", name, "--dtype", "float16"])
    assert f"{kv_bytes_per_token:,} bytes" in capsys.readouterr().out


def test_tensor_parallelism_refuses_norms_over_every_head():
    """OLMo-2 normalizes q and k over all heads at once: no rank holds them all."""
    from kvserve.distributed.tensor_parallel import check_shardable
    from kvserve.models.registry import read_model_config
    with pytest.raises(ValueError, match="q and k norms span every head"):
        check_shardable(read_model_config("olmo-2-7b"), 2)
    for name in ("qwen3-8b", "smollm3-3b", "granite-3.3-8b", "phi-4-mini"):  # per-head norms or none: they split
        check_shardable(read_model_config(name), 2)
