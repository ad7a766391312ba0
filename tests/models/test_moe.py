"""Mixture-of-experts models (kvserve.models.moe) equal transformers: logits within 1e-4 and the
same greedy tokens for tiny random Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE models, decoded
through the engine under batching, chunked prefill, prefix hits, n > 1 and preemption (recompute
and swap); the routers (softmax, sigmoid, grouped top-k with DeepSeek's correction bias) and
DeepSeek's block equal transformers' modules; the grouped expert path equals a per-token loop
and runs only the chosen experts; a GGUF with stacked (Q8_0) experts loads packed and matches."""

import dataclasses

import pytest
import torch

from kvserve.config import ModelConfig, MoEConfig
from kvserve.models.moe import DeepseekMoeBlock, Router, SparseMoeBlock, grouped_experts
from tests.conftest import greedy, make_engine, run_collecting_logits
from tests.models.test_hf_parity import full_logits
from tests.runner.test_fast_path import layer_kernels_built

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(  # layer 0 dense
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=2)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_only_layers=[0], norm_topk_prob=True)),
    "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **COMMON, num_experts=8, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1)),
}


def randomized(model):
    """Random weights scaled so routing and greedy paths are not degenerate."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    return model.eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    from kvserve.models.registry import load_weights
    torch.manual_seed(0)
    hf = randomized(FAMILIES[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return request.param, hf, load_weights(str(path))


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_logits_equal_transformers(family):
    from kvserve.models.registry import build_model
    name, hf, loaded = family
    assert loaded.config.architecture == name and loaded.config.moe is not None
    ours = build_model(loaded, torch.float32, "cpu", 256)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert (full_logits(ours, ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4


def prompts():
    """Four prompts sharing a 12-token prefix (three full blocks of 4), of different lengths."""
    shared = [(5 * j + 3) % 120 + 4 for j in range(12)]
    return [shared + [(7 * i + j) % 120 + 4 for j in range(n)] for i, n in enumerate((1, 6, 9, 3))]


def assert_as_transformers(hf, prompt, out, rows):
    """The output's greedy tokens are transformers' argmax over the whole sequence, and each
    step's logits equal transformers' for that position within 1e-4."""
    seq = prompt + out.token_ids
    ref = hf_logits(hf, seq)[len(prompt) - 1:len(seq) - 1]
    assert out.token_ids == ref.argmax(-1).tolist()
    if rows is not None:
        assert (torch.stack(rows) - ref).abs().max().item() < 1e-4


SCENARIOS = {
    # batched, prefills chunked to 5 tokens, a 7-token step budget; the first prompt runs alone
    # first so the others hit its cached prefix; n = 2 forks the last one
    "batched-chunked-prefix-n2": dict(block_size=4, num_blocks=64, max_num_batched_tokens=7, max_prefill_chunk=5),
    "preempt-recompute": dict(block_size=4, num_blocks=12, preemption_mode="recompute"),
    "preempt-swap": dict(block_size=4, num_blocks=12, preemption_mode="swap", swap_space=1 << 22),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_engine_decodes_as_transformers(family, scenario):
    _, hf, loaded = family
    engine = make_engine(loaded, **SCENARIOS[scenario])
    ps = prompts()
    if scenario.startswith("batched"):
        (first,), logits = run_collecting_logits(engine, ps[:1], greedy(8, ignore_eos=True))
        assert_as_transformers(hf, ps[0], first.outputs[0], next(iter(logits.values())))
        outs, logits = run_collecting_logits(engine, ps[1:3], greedy(8, ignore_eos=True))
        (forked,), _ = run_collecting_logits(engine, ps[3:], dataclasses.replace(greedy(8, ignore_eos=True), n=2))
        assert engine.stats().scheduler.prefix_hit_rate > 0
        assert len(forked.outputs) == 2
        for sample in forked.outputs:
            assert_as_transformers(hf, ps[3], sample, None)
        ps = ps[1:3]
    else:
        outs, logits = run_collecting_logits(engine, ps, greedy(8, ignore_eos=True))
        assert engine.stats().scheduler.num_preemptions > 0
    for prompt, out, rows in zip(ps, outs, logits.values()):
        assert_as_transformers(hf, prompt, out.outputs[0], rows)
    assert engine.kv.pool.num_used_blocks == 0


# ---- the routers and DeepSeek's block against transformers' modules ----
def tiny_model_config(moe: MoEConfig) -> ModelConfig:
    return ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, moe=moe)


def deepseek_pair(version: int):
    """transformers' DeepSeek-V2 (softmax, group max) or V3 (sigmoid, top-2 group sum, bias) MoE
    module with random weights, and ours holding the same."""
    common = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                  num_experts_per_tok=3, n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    if version == 2:
        cfg = transformers.DeepseekV2Config(**common, topk_method="group_limited_greedy")
        theirs = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe(cfg)
        moe = MoEConfig(8, 3, 16, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=False,
                        shared_expert_intermediate_size=32)
    else:
        cfg = transformers.DeepseekV3Config(**common, norm_topk_prob=True)
        theirs = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(cfg)
        moe = MoEConfig(8, 3, 16, scoring="sigmoid", n_group=4, topk_group=2, group_score="top2_sum",
                        score_correction_bias=True, routed_scaling_factor=2.5, shared_expert_intermediate_size=32)
    torch.manual_seed(version)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        if version == 3:
            theirs.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    ours = DeepseekMoeBlock(tiny_model_config(moe), 0)
    ours.load_state_dict(per_expert(theirs.state_dict()), strict=True)
    return theirs.eval(), ours


def per_expert(sd):
    from kvserve.models.loaders.experts import hf_expert_names
    return {k.removeprefix("x.mlp."): v for k, v in hf_expert_names({f"x.mlp.{k}": v for k, v in sd.items()}).items()}


@pytest.mark.parametrize("version", [2, 3])
def test_deepseek_block_equals_transformers(version):
    theirs, ours = deepseek_pair(version)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = theirs(x.unsqueeze(0))[0]
        _, ref_weights, ref_ids = theirs.gate(x)
    weights, ids = ours.gate(x)
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    assert torch.allclose(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices), atol=1e-6)
    assert (ours(x) - ref).abs().max().item() < 1e-5


def test_grouped_top_k_keeps_to_the_best_groups():
    """Two groups of four; the best group holds the token's top score, so with topk_group 1 all
    three choices come from it even where the other group has the second-best expert."""
    moe = MoEConfig(8, 3, 16, n_group=2, topk_group=1, norm_topk_prob=False)
    router = Router(4, moe)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, 0] = torch.tensor([9.0, 1, 1, 1, 8, 0, 0, 0])
    weights, ids = router(torch.tensor([[1.0, 0, 0, 0]]))
    assert sorted(ids[0].tolist())[0] == 0 and set(ids[0].tolist()) <= {0, 1, 2, 3}
    plain = Router(4, dataclasses.replace(moe, n_group=1))
    plain.load_state_dict(router.state_dict())
    assert 4 in plain(torch.tensor([[1.0, 0, 0, 0]]))[1][0].tolist()


def per_token_loop(block, x):
    """The reference: each token through each of its chosen experts, one at a time."""
    weights, ids = block.gate(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t]):
            out[t] += w * block.experts[int(e)](x[t:t + 1])[0]
    return out


def test_grouped_experts_equal_a_per_token_loop_and_skip_unchosen_experts():
    moe = MoEConfig(8, 2, 16, shared_expert_intermediate_size=24, shared_expert_gate=True)
    torch.manual_seed(0)
    block = SparseMoeBlock(tiny_model_config(moe), 0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    x = torch.randn(13, 32)
    weights, ids = block.gate(x)
    routed = grouped_experts(x, weights, ids, block.experts)
    assert (routed - per_token_loop(block, x)).abs().max().item() < 1e-6
    shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    assert (block(x) - routed - shared).abs().max().item() < 1e-6
    calls = []
    for e, expert in enumerate(block.experts):  # a decode step of one token runs its 2 experts only
        expert.forward = lambda h, e=e, f=expert.forward: calls.append((e, h.shape[0])) or f(h)
    block(x[:1])
    assert sorted(calls) == sorted((int(e), 1) for e in block.gate(x[:1])[1][0])
    calls.clear()
    block(x)  # a batch: each active expert once, over all its tokens
    counts = torch.bincount(block.gate(x)[1].reshape(-1), minlength=8)
    assert sorted(calls) == [(e, int(n)) for e, n in enumerate(counts) if n]


# ---- GGUF: experts stacked as llama.cpp writes them ----
def write_moe_gguf(path, hf, expert_type):
    """A Mixtral or Qwen2-MoE as llama.cpp converts it: Mixtral as arch llama with experts and
    q/k rows permuted for its RoPE; Qwen2-MoE as qwen2moe with q/k/v biases and the shared
    expert (its gate a [hidden] vector); experts stacked [E, N, K] in `expert_type`, the rest F32."""
    import gguf
    import numpy as np
    cfg, sd = hf.config, {k: v.numpy() for k, v in hf.state_dict().items()}
    qwen = cfg.model_type == "qwen2_moe"
    w = gguf.GGUFWriter(str(path), "qwen2moe" if qwen else "llama")
    w.add_block_count(cfg.num_hidden_layers), w.add_context_length(256), w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size), w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads), w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"]), w.add_vocab_size(cfg.vocab_size)
    w.add_expert_count(cfg.num_experts if qwen else cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if qwen:
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2"), w.add_token_merges(["a b"])
    w.add_token_list(["a", "b", "ab"] + [f"t{i}" for i in range(3, cfg.vocab_size)])

    def permute(a, heads):
        if qwen:  # NEOX RoPE: stored as Hugging Face holds it
            return a
        return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    def add(name, a, kind=gguf.GGMLQuantizationType.F32):
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), kind), raw_dtype=kind)

    add("token_embd.weight", sd["model.embed_tokens.weight"]), add("output_norm.weight", sd["model.norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        add(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        named = [("attn_v.weight", "self_attn.v_proj.weight"), ("attn_output.weight", "self_attn.o_proj.weight"),
                 ("attn_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
                 ("ffn_gate_inp.weight", "mlp.gate.weight")]
        if qwen:
            named += [(f"attn_{x}.bias", f"self_attn.{x}_proj.bias") for x in "qkv"]
            named += [(f"ffn_{x}_shexp.weight", f"mlp.shared_expert.{x}_proj.weight") for x in ("gate", "up", "down")]
            add(f"blk.{i}.ffn_gate_inp_shexp.weight", sd[p + "mlp.shared_expert_gate.weight"][0])
        for ours, theirs in named:
            add(f"blk.{i}.{ours}", sd[p + theirs])
        gate, up = np.split(sd[p + "mlp.experts.gate_up_proj"], 2, axis=1)
        for ours, a in (("ffn_gate_exps", gate), ("ffn_up_exps", up), ("ffn_down_exps", sd[p + "mlp.experts.down_proj"])):
            add(f"blk.{i}.{ours}.weight", a, expert_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


def test_gguf_stacked_q8_experts_load_packed_and_match_transformers(tmp_path):
    import gguf
    from kvserve.models.packed import PackedLinear
    from kvserve.models.registry import build_model, load_weights
    torch.manual_seed(0)
    hf = randomized(FAMILIES["mixtral"]())
    write_moe_gguf(tmp_path / "m.gguf", hf, gguf.GGMLQuantizationType.Q8_0)
    with torch.no_grad():  # transformers with the experts the gguf package dequantizes from the file
        for layer in hf.model.layers:
            for name in ("gate_up_proj", "down_proj"):
                p = getattr(layer.mlp.experts, name)
                q8 = gguf.quants.quantize(p.numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)).reshape(p.shape))
    loaded = load_weights(str(tmp_path / "m.gguf"))
    assert loaded.config.architecture == "mixtral" and loaded.config.moe.num_experts == 4
    ours = build_model(loaded, torch.float32, "cpu", 256)
    experts = ours.model.layers[1].mlp.experts
    assert all(isinstance(e.down_proj, PackedLinear) for e in experts)  # kept packed
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    assert (full_logits(ours, ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4
    engine = make_engine(loaded, block_size=4, num_blocks=64, exact=True)
    if layer_kernels_built():  # each packed expert runs the MLP's fast form (fused gate|up)
        assert any(name.endswith("mlp.experts.0") for name in engine.runner.fast_path)
    (out,), logits = run_collecting_logits(engine, [ids[:9]], greedy(8, ignore_eos=True))
    assert_as_transformers(hf, ids[:9], out.outputs[0], next(iter(logits.values())))


def test_bad_moe_configs_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEConfig(4, 5, 16)
    with pytest.raises(ValueError, match="n_group"):
        MoEConfig(8, 2, 16, n_group=3)
    with pytest.raises(ValueError, match="scoring"):
        MoEConfig(8, 2, 16, scoring="relu")
    with pytest.raises(ValueError, match="dense_layers"):
        tiny_model_config(MoEConfig(8, 2, 16, dense_layers=(1,)))


def test_memory_reports_the_weight_bytes_a_decode_token_reads(capsys):
    """Mixtral-8x7B: 46.7B parameters; a token reads the attention, norms and router of every
    layer and 2 of its 8 experts, plus one embedding row and the head."""
    from kvserve.cli import _print_weights, memory_report
    H, V, L, expert = 4096, 32000, 32, 3 * 4096 * 14336
    attention, norms, router = 2 * H * H + 2 * H * 1024, 2 * H, 8 * H
    w = memory_report("mixtral-8x7b", 4096, 1, "auto", 16, "bfloat16")["weights"]
    assert w["params"] == 2 * V * H + H + L * (attention + norms + router + 8 * expert) == 46_702_792_704
    assert w["params_per_token"] == V * H + H + L * (attention + norms + router + 2 * expert)
    assert w["bytes_per_token"] == 2 * w["params_per_token"] and (w["experts"], w["experts_per_token"]) == (8, 2)
    _print_weights(w)
    assert "a decode token reads 12.75B" in capsys.readouterr().out
    dense = memory_report("llama-3-8b", 4096, 1, "auto", 16, "bfloat16")["weights"]
    assert dense["experts"] is None and dense["params"] == 8_030_261_248


def test_tensor_parallelism_refuses_experts_clearly():
    from kvserve.distributed.tensor_parallel import check_shardable
    from kvserve.models.registry import KNOWN_CONFIGS
    with pytest.raises(ValueError, match="experts"):
        check_shardable(KNOWN_CONFIGS["mixtral-8x7b"], 2)
    check_shardable(KNOWN_CONFIGS["mixtral-8x7b"], 1)


def test_gguf_qwen2_moe_with_its_shared_expert_matches_transformers(tmp_path):
    """qwen2moe: biases, the shared expert and its [hidden] gate, expert_feed_forward_length."""
    import gguf
    from kvserve.models.registry import build_model, load_weights
    torch.manual_seed(0)
    hf = randomized(transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)))
    write_moe_gguf(tmp_path / "q.gguf", hf, gguf.GGMLQuantizationType.F32)
    loaded = load_weights(str(tmp_path / "q.gguf"))
    moe = loaded.config.moe
    assert loaded.config.architecture == "qwen2_moe" and loaded.config.attention_bias
    assert (moe.moe_intermediate_size, moe.shared_expert_intermediate_size, moe.shared_expert_gate) == (32, 48, True)
    ours = build_model(loaded, torch.float32, "cpu", 256)
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    assert (full_logits(ours, ids) - hf_logits(hf, ids)).abs().max().item() < 1e-4
