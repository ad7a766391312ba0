"""DeepSeek-V2/V3 from GGUF (llama.cpp's deepseek2): a tiny random transformers model written
with the gguf package as llama.cpp's converter lays it out (kv_b_proj whole, as older files hold
it, or split into attn_k_b (transposed) and attn_v_b, as newer ones do; experts stacked; V3's
sigmoid routing with its correction bias and groups; YaRN keys) loads to the same config and
weights as the Hugging Face directory: logits equal within 1e-5, greedy tokens equal to
transformers' generate through the engine."""

import pytest
import torch

from kvserve.models.registry import build_model, load_weights
from tests.conftest import greedy, make_engine, run_collecting_logits
from tests.models.test_hf_parity import full_logits
from tests.models.test_mla import build_hf, hf_greedy, prompts

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")


def write_header(w, cfg, split_kv_b):
    """deepseek2 metadata as llama.cpp's converter writes it (newer files: the MQA view's key and
    value lengths, the per-head ones under *_mla; older: the per-head ones as key/value length)."""
    w.add_block_count(cfg.num_hidden_layers), w.add_context_length(256), w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size), w.add_head_count(cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps), w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size), w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_kv_lora_rank(cfg.kv_lora_rank), w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    if split_kv_b:
        w.add_head_count_kv(1), w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank), w.add_value_length_mla(cfg.v_head_dim)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    else:
        w.add_head_count_kv(cfg.num_attention_heads), w.add_value_length(cfg.v_head_dim)
        w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size), w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok), w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    v3 = cfg.model_type == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if v3:
        w.add_expert_group_count(cfg.n_group), w.add_expert_group_used_count(cfg.topk_group)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"]), w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_tokenizer_model("gpt2"), w.add_token_merges(["a b"])
    w.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(3, cfg.vocab_size)])


def write_deepseek_gguf(path, hf, split_kv_b, q8_names=()):
    """The file; tensors whose GGUF name contains one of q8_names stored as Q8_0, the rest F32."""
    cfg, sd = hf.config, {k: v.numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "deepseek2")
    write_header(w, cfg, split_kv_b)

    def add(name, a):
        kind = gguf.GGMLQuantizationType.Q8_0 if any(q in name for q in q8_names) else gguf.GGMLQuantizationType.F32
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), kind), raw_dtype=kind)

    add("token_embd.weight", sd["model.embed_tokens.weight"]), add("output_norm.weight", sd["model.norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in layer_names(cfg, i):
            if p + theirs in sd:
                add(b + ours, sd[p + theirs])
        kv_b = sd[p + "self_attn.kv_b_proj.weight"]
        if split_kv_b:  # per head [W_UK; W_UV]; W_UK stored transposed [H, rank, nope]
            per_head = kv_b.reshape(cfg.num_attention_heads, -1, cfg.kv_lora_rank)
            add(b + "attn_k_b.weight", per_head[:, :cfg.qk_nope_head_dim].transpose(0, 2, 1))
            add(b + "attn_v_b.weight", per_head[:, cfg.qk_nope_head_dim:])
        else:
            add(b + "attn_kv_b.weight", kv_b)
        if p + "mlp.experts.gate_up_proj" in sd:
            gate, up = np.split(sd[p + "mlp.experts.gate_up_proj"], 2, axis=1)
            add(b + "ffn_gate_exps.weight", gate), add(b + "ffn_up_exps.weight", up)
            add(b + "ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])
        if p + "mlp.gate.e_score_correction_bias" in sd:
            add(b + "exp_probs_b.bias", sd[p + "mlp.gate.e_score_correction_bias"])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


def layer_names(cfg, i):
    attn = [("attn_q", "q_proj"), ("attn_q_a", "q_a_proj"), ("attn_q_a_norm", "q_a_layernorm"),
            ("attn_q_b", "q_b_proj"), ("attn_kv_a_mqa", "kv_a_proj_with_mqa"), ("attn_kv_a_norm", "kv_a_layernorm"),
            ("attn_output", "o_proj")]
    mlp = [("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj"), ("ffn_gate_inp", "gate")]
    mlp += [(f"ffn_{x}_shexp", f"shared_experts.{x}_proj") for x in ("gate", "up", "down")]
    return ([(f"{a}.weight", f"self_attn.{b}.weight") for a, b in attn]
            + [(f"{a}.weight", f"mlp.{b}.weight") for a, b in mlp]
            + [("attn_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight")])


CASES = {"v2-lite-moe": False, "v3-moe": True, "v3-yarn": True}  # config: kv_b split as newer files hold it


def build_pair(tmp_path, name):
    """The HF directory (V3's router correction biases made nonzero, so the file's exp_probs_b
    counts) and the GGUF of the same weights."""
    hf = build_hf(tmp_path / "hf", name)
    with torch.no_grad():
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(5)) * 0.5)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    write_deepseek_gguf(tmp_path / "m.gguf", hf, CASES[name])
    return hf


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_loads_as_the_hf_directory(name, tmp_path):
    hf = build_pair(tmp_path, name)
    ours, ref = load_weights(str(tmp_path / "m.gguf")), load_weights(str(tmp_path / "hf"))
    assert ours.config.rms_norm_eps == pytest.approx(ref.config.rms_norm_eps)  # the file keeps fp32
    for field in ("mla", "moe", "head_dim", "architecture", "rope_scaling", "num_hidden_layers"):
        a, b = getattr(ours.config, field), getattr(ref.config, field)
        if field == "rope_scaling" and b is not None:  # the HF config names more keys than the file keeps (fp32)
            assert a["rope_type"] == b["rope_type"] == "yarn"
            a, b = {k: v for k, v in a.items() if k != "rope_type"}, {k: b[k] for k in a if k != "rope_type"}
            b = pytest.approx(b)
        assert a == b, field
    model, ref_model = (build_model(x, torch.float32, "cpu", 256) for x in (ours, ref))
    ids = prompts(1, seed=7)[0] * 3
    assert (full_logits(model, ids) - full_logits(ref_model, ids)).abs().max().item() < 1e-5
    with torch.no_grad():
        assert (full_logits(model, ids) - hf(torch.tensor([ids])).logits[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["v2-lite-moe", "v3-moe"])
def test_gguf_greedy_tokens_equal_transformers(name, tmp_path):
    hf = build_pair(tmp_path, name)
    engine = make_engine(load_weights(str(tmp_path / "m.gguf")), block_size=4, num_blocks=64)
    outs, _ = run_collecting_logits(engine, prompts(), greedy(8, ignore_eos=True))
    for out in outs:
        assert out.prompt_token_ids + out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 8)[0]


def test_a_file_without_kv_b_is_refused_naming_it(tmp_path):
    hf = build_hf(tmp_path / "hf", "v2-lite-dense")
    path = tmp_path / "m.gguf"
    write_deepseek_gguf(path, hf, split_kv_b=False)
    from kvserve.models.loaders import gguf_deepseek
    loaded_cfg = load_weights(str(path)).config
    with pytest.raises(Exception, match="needs attn_kv_b .or attn_k_b and attn_v_b. in every layer"):
        gguf_deepseek.latent_tensors({}, loaded_cfg)


def test_q8_kv_b_is_dequantized_and_q8_experts_stay_packed(tmp_path):
    """kv_b_proj is folded into queries and outputs: read as float whatever the file's type;
    the experts' gate and up products keep their Q8_0 blocks. Logits equal transformers holding the weights the gguf
    package dequantizes from the file."""
    from kvserve.models.packed import PackedWeight
    hf = build_pair(tmp_path, "v2-lite-moe")
    write_deepseek_gguf(tmp_path / "q.gguf", hf, False, q8_names=("attn_kv_b", "ffn_gate_exps", "ffn_up_exps"))
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "kv_b_proj" in n or n.endswith("mlp.experts.gate_up_proj"):  # (down: rows of 24, no Q8_0 blocks)
                q8 = gguf.quants.quantize(p.numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)).reshape(p.shape))
    loaded = load_weights(str(tmp_path / "q.gguf"))
    sd = loaded.state_dict
    assert all(isinstance(sd[f"model.layers.1.mlp.experts.{e}.{p}.weight"], PackedWeight)
               for e in range(4) for p in ("gate_proj", "up_proj"))
    model = build_model(loaded, torch.float32, "cpu", 256)
    assert isinstance(model.model.layers[1].self_attn.kv_b_proj.weight, torch.Tensor)
    ids = prompts(1, seed=7)[0] * 3
    with torch.no_grad():
        assert (full_logits(model, ids) - hf(torch.tensor([ids])).logits[0]).abs().max().item() < 1e-4
