"""DeepSeek-V2/V3 from GGUF: llama.cpp's `deepseek2` architecture, read into kvserve's DeepSeek
(kvserve.models.deepseek: latent attention over the latent cache, routed and shared experts).

What llama.cpp's converter writes, and how it is read back:

    metadata                                   kvserve
    attention.kv_lora_rank, q_lora_rank       MLAConfig.kv_lora_rank, q_lora_rank (absent: q_proj)
    rope.dimension_count                      qk_rope_head_dim
    attention.key_length_mla / value_length_mla   qk_nope + qk_rope, v_head_dim (newer files; there
                                              key_length is kv_lora_rank + rope, the MQA view)
    attention.key_length / value_length       the same in older files (no *_mla keys)
    attention.head_count_kv                   1 in newer files (the MQA view): ignored, MLA has one
                                              latent per token whatever it says
    leading_dense_block_count                 MoEConfig.dense_layers (first_k_dense_replace)
    expert_count, expert_used_count, expert_feed_forward_length, expert_shared_count
                                              experts, top-k, moe size, shared size = count * size
    expert_gating_func                        1 softmax (V2), 2 sigmoid (V3: with exp_probs_b, the
                                              e_score_correction_bias, and top-2-sum groups)
    expert_group_count, expert_group_used_count   n_group, topk_group (absent: no groups)
    expert_weights_scale, expert_weights_norm     routed_scaling_factor, norm_topk_prob
    rope.scaling.type yarn, .factor, .original_context_length, .yarn_log_multiplier (0.1 *
    mscale_all_dim), .yarn_beta_fast/slow     rope_scaling {"rope_type": "yarn", ...}

    tensors                                    kvserve (Hugging Face names)
    attn_q | attn_q_a, attn_q_a_norm, attn_q_b    q_proj | q_a_proj, q_a_layernorm, q_b_proj
    attn_kv_a_mqa, attn_kv_a_norm             kv_a_proj_with_mqa, kv_a_layernorm
    attn_kv_b [H (nope + v), rank]            kv_b_proj (older files)
    attn_k_b [H, rank, nope], attn_v_b [H, v, rank]   kv_b_proj, per head [W_UK; W_UV] (newer
                                              files split it, W_UK transposed, for llama.cpp's
                                              absorbed attention)
    ffn_*_shexp                               mlp.shared_experts.*_proj
    exp_probs_b.bias                          mlp.gate.e_score_correction_bias

The rotary channels stay as DeepSeek lays them out (interleaved pairs; llama.cpp rotates them
the same way), so nothing is permuted; kv_b_proj is always dequantized (the model folds it into
its queries and outputs as a float weight).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import torch

from kvserve.config import MLAConfig, ModelConfig, MoEConfig
from kvserve.models.loaders.base import ModelLoadError

ARCH = "deepseek2"
GGUF_LAYER_RENAMES = {
    "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_LATENT = re.compile(r"blk\.(\d+)\.(attn_kv_b|attn_k_b|attn_v_b|exp_probs_b)\.(weight|bias)")

Getter = Callable[..., Any]  # get(key, default) reads deepseek2.{key}


def config_fields(get: Getter, path: str, num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields a deepseek2 file sets beyond the common ones."""
    rope, heads = _required(get, path, "rope.dimension_count"), _required(get, path, "attention.head_count")
    nope_rope = get("attention.key_length_mla") or _required(get, path, "attention.key_length")
    v_dim = get("attention.value_length_mla") or _required(get, path, "attention.value_length")
    q_rank = get("attention.q_lora_rank")
    mla = MLAConfig(_required(get, path, "attention.kv_lora_rank"), int(nope_rope) - rope, rope, int(v_dim),
                    int(q_rank) if q_rank else None, rope_interleave=True)
    moe = _moe_config(get, num_layers)
    head_dim = mla.qk_nope_head_dim + rope  # a query head (as the HF load; the file's key_length may be the MQA view's)
    return {"mla": mla, "moe": moe, "head_dim": head_dim, "rotary_dim": head_dim, "num_key_value_heads": heads,
            "rope_scaling": _yarn(get, path), "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            # the same model class either way; V3 is the one that routes by sigmoid
            "architecture": "deepseek_v3" if int(get("expert_gating_func", 1)) == 2 else "deepseek_v2"}


def _required(get: Getter, path: str, key: str) -> int:
    value = get(key)
    if value is None:
        raise ModelLoadError(f"{path}: a {ARCH} file needs {ARCH}.{key}")
    return int(value)


def _moe_config(get: Getter, num_layers: int) -> Optional[MoEConfig]:
    count, dense = get("expert_count"), min(int(get("leading_dense_block_count", 0)), num_layers)
    if not count or dense == num_layers:  # no layer routes (the file may still describe experts)
        return None
    size, sigmoid = int(get("expert_feed_forward_length")), int(get("expert_gating_func", 1)) == 2
    return MoEConfig(
        int(count), int(get("expert_used_count")), size, scoring="sigmoid" if sigmoid else "softmax",
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0) or 1.0),
        n_group=int(get("expert_group_count", 1) or 1), topk_group=int(get("expert_group_used_count", 1) or 1),
        group_score="top2_sum" if sigmoid else "max", score_correction_bias=sigmoid,
        shared_expert_intermediate_size=size * int(get("expert_shared_count", 0)),
        dense_layers=tuple(range(dense)))


def _yarn(get: Getter, path: str) -> Optional[dict[str, Any]]:
    """DeepSeek's YaRN from the file: llama.cpp keeps mscale_all_dim as 0.1 x it in
    yarn_log_multiplier and assumes mscale equal to it (as DeepSeek's configs have them)."""
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise ModelLoadError(f"{path}: rope scaling {kind!r} is not DeepSeek's (yarn)")
    mscale = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    return {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
            "mscale": mscale, "mscale_all_dim": mscale, "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0))}


def latent_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """kv_b_proj per layer (from attn_kv_b, or attn_k_b and attn_v_b joined back) and the routers'
    correction biases, in HF names; tensors: those of the file `_LATENT` names, dequantized."""
    m = cfg.mla
    assert m is not None
    H, out = cfg.num_attention_heads, {}
    layers = sorted({int(n.split(".")[1]) for n in tensors})
    for i in layers:
        prefix, name = f"blk.{i}.", f"model.layers.{i}."
        if f"{prefix}exp_probs_b.bias" in tensors:
            out[f"{name}mlp.gate.e_score_correction_bias"] = tensors[f"{prefix}exp_probs_b.bias"]
        if f"{prefix}attn_kv_b.weight" in tensors:
            out[f"{name}self_attn.kv_b_proj.weight"] = tensors[f"{prefix}attn_kv_b.weight"]
        elif f"{prefix}attn_k_b.weight" in tensors and f"{prefix}attn_v_b.weight" in tensors:
            k_b = tensors[f"{prefix}attn_k_b.weight"].reshape(H, m.kv_lora_rank, m.qk_nope_head_dim)
            v_b = tensors[f"{prefix}attn_v_b.weight"].reshape(H, m.v_head_dim, m.kv_lora_rank)
            kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, nope + v, rank]
            out[f"{name}self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, m.kv_lora_rank).contiguous()
    missing = [i for i in range(cfg.num_hidden_layers) if f"model.layers.{i}.self_attn.kv_b_proj.weight" not in out]
    if missing:
        raise ModelLoadError(f"a {ARCH} file needs attn_kv_b (or attn_k_b and attn_v_b) in every layer; "
                             f"layers {missing} have neither")
    return out


def is_latent_tensor(name: str) -> bool:
    """Whether the file's tensor `name` is read by latent_tensors (dequantized, joined)."""
    return _LATENT.fullmatch(name) is not None
