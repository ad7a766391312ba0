"""Mixture-of-experts checkpoints in kvserve's names: the routing rule read into `MoEConfig`
(from a Hugging Face config.json or GGUF metadata) and the experts' tensors renamed to one
matrix per expert, mlp.experts.{e}.{gate,up,down}_proj.weight, the router as mlp.gate.weight.

Hugging Face checkpoints store experts one matrix each (Mixtral as block_sparse_moe.experts.{e}.
w1/w3/w2, the others as mlp.experts.{e}.gate_proj/up_proj/down_proj) or, as transformers 5 holds
them, stacked: mlp.experts.gate_up_proj [E, 2I, hidden] and mlp.experts.down_proj [E, hidden, I].
GGUF (llama.cpp) stacks them as ffn_gate_exps / ffn_up_exps / ffn_down_exps [E, N, K]; a
packed type (Q8_0, Q4_0, Q4_1) is split into E packed matrices of the file's own bytes.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import torch

from kvserve.config import MoEConfig
from kvserve.models.loaders.base import ModelLoadError
from kvserve.models.packed import BY_GGML_TYPE, PackedWeight

HF_MOE_ARCHS = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe"}
HF_MOE_MODEL_TYPES = {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "olmoe": "olmoe"}
# GGUF general.architecture -> kvserve's; Mixtral is llama.cpp's "llama" with experts
GGUF_MOE_ARCHS = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
GGUF_LAYER_RENAMES = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# whether each family renormalizes its top-k weights where the file does not say
NORM_TOPK_DEFAULT = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": False, "olmoe": False}

Getter = Callable[..., Any]  # get(key, kind, default)


def hf_moe_config(get: Getter, arch: str, num_layers: int, intermediate_size: int) -> Optional[MoEConfig]:
    """The MoEConfig of a config.json's fields (get(key, kind, default) type-checks each); None
    for a dense family."""
    if arch not in NORM_TOPK_DEFAULT:
        return None
    if arch == "olmoe" and get("clip_qkv", float, None) is not None:
        raise ModelLoadError("OLMoE's clip_qkv is not supported (the published checkpoints set none)")
    experts = get("num_local_experts", int, None) if arch == "mixtral" else \
        get("num_experts", int, get("num_local_experts", int, None))
    if experts is None:
        raise ModelLoadError(f"field 'num_experts' is missing: {arch} is a mixture of experts")
    expert_size = intermediate_size if arch in ("mixtral", "olmoe") else get("moe_intermediate_size", int)
    shared = get("shared_expert_intermediate_size", int, 0) if arch == "qwen2_moe" else 0
    return MoEConfig(experts, get("num_experts_per_tok", int), expert_size,
                     norm_topk_prob=get("norm_topk_prob", bool, NORM_TOPK_DEFAULT[arch]),
                     shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0,
                     dense_layers=_qwen_dense_layers(get, num_layers) if arch.startswith("qwen") else ())


def _qwen_dense_layers(get: Getter, num_layers: int) -> tuple[int, ...]:
    """Qwen-MoE's dense layers: those in mlp_only_layers, and all but every decoder_sparse_step-th."""
    step = get("decoder_sparse_step", int, 1)
    if step < 1:
        raise ModelLoadError(f"field 'decoder_sparse_step' must be >= 1, got {step}")
    only = get("mlp_only_layers", list, [])
    if not all(isinstance(i, int) and 0 <= i < num_layers for i in only):
        raise ModelLoadError(f"field 'mlp_only_layers' must list layers 0..{num_layers - 1}, got {only}")
    return tuple(i for i in range(num_layers) if i in only or (i + 1) % step)


def deepseek_moe_config(get: Getter, num_layers: int) -> MoEConfig:
    """DeepSeek-V2/V3's routing from config.json: softmax (V2) or sigmoid (V3, scoring_func) scores,
    group_limited_greedy (group max) or noaux_tc (top-2 sum, with e_score_correction_bias),
    n_shared_experts MLPs of moe_intermediate_size, the first first_k_dense_replace layers dense."""
    method = get("topk_method", str, "greedy")
    sigmoid = get("scoring_func", str, "softmax") == "sigmoid" or method == "noaux_tc"
    grouped = method in ("group_limited_greedy", "noaux_tc")
    size = get("moe_intermediate_size", int)
    return MoEConfig(
        get("n_routed_experts", int), get("num_experts_per_tok", int), size,
        scoring="sigmoid" if sigmoid else "softmax", norm_topk_prob=get("norm_topk_prob", bool, False),
        routed_scaling_factor=get("routed_scaling_factor", float, 1.0),
        n_group=get("n_group", int, 1) if grouped else 1, topk_group=get("topk_group", int, 1) if grouped else 1,
        group_score="top2_sum" if method == "noaux_tc" else "max", score_correction_bias=method == "noaux_tc",
        shared_expert_intermediate_size=size * get("n_shared_experts", int, 0),
        dense_layers=tuple(range(min(get("first_k_dense_replace", int, 0), num_layers))))


_MIXTRAL = re.compile(r"(.*)\.block_sparse_moe\.(gate\.weight|experts\.(\d+)\.(w[123])\.weight)")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")


def hf_expert_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with Mixtral's names and stacked experts turned into one matrix per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        m, s = _MIXTRAL.fullmatch(name), _STACKED.fullmatch(name)
        if m and m.group(3) is None:
            out[f"{m.group(1)}.mlp.gate.weight"] = w
        elif m:
            out[f"{m.group(1)}.mlp.experts.{m.group(3)}.{_MIXTRAL_PROJ[m.group(4)]}.weight"] = w
        elif s and w.dim() == 3:
            out.update(_unstack(s.group(1), s.group(2), w))
        else:
            out[name] = w
    return out


def _unstack(prefix: str, kind: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """[E, 2I, hidden] gate|up (or [E, hidden, I] down) -> one matrix per expert and projection."""
    if kind == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": w[e].contiguous() for e in range(w.shape[0])}
    half = w.shape[1] // 2
    return {f"{prefix}.{e}.{p}.weight": part.contiguous() for e in range(w.shape[0])
            for p, part in (("gate_proj", w[e, :half]), ("up_proj", w[e, half:]))}


def gguf_moe_config(get: Getter, arch: str, num_layers: int, ffn_length: int) -> Optional[MoEConfig]:
    """The MoEConfig of GGUF metadata (get(key, default) reads {arch}.{key}); None without experts."""
    count = get("expert_count")
    if not count:
        return None
    family = GGUF_MOE_ARCHS.get(arch, "mixtral")
    gating = int(get("expert_gating_func", 1))  # llama.cpp: 1 softmax, 2 sigmoid
    shared = int(get("expert_shared_feed_forward_length", 0))
    return MoEConfig(int(count), int(get("expert_used_count")), int(get("expert_feed_forward_length", ffn_length)),
                     scoring="sigmoid" if gating == 2 else "softmax",
                     norm_topk_prob=bool(get("expert_weights_norm", NORM_TOPK_DEFAULT[family])),
                     routed_scaling_factor=float(get("expert_weights_scale", 1.0) or 1.0),
                     shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0 and family == "qwen2_moe",
                     dense_layers=tuple(range(min(int(get("leading_dense_block_count", 0)), num_layers))))


_GGUF_EXPERTS = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight")


def gguf_experts(name: str, shape: tuple[int, ...], ggml_type: int,
                 read: Callable[[], Any]) -> Optional[dict[str, Any]]:
    """One stacked expert tensor [E, N, K] as E matrices in HF names, each a PackedWeight of the
    file's bytes for a packed type (read() gives the raw uint8 bytes) or float32 (read() gives
    the dequantized [E, N, K]); None where `name` is no expert tensor."""
    m = _GGUF_EXPERTS.fullmatch(name)
    if m is None:
        return None
    if len(shape) != 3:
        raise ModelLoadError(f"expert tensor {name} must be 3-D [experts, rows, columns], got shape {shape}")
    prefix = f"model.layers.{m.group(1)}.mlp.experts"
    proj, (E, N, K) = GGUF_EXPERTS[m.group(2)], shape
    data = read()
    if ggml_type in BY_GGML_TYPE:
        fmt = BY_GGML_TYPE[ggml_type]
        rows = data.reshape(E, N, fmt.row_bytes(K))
        return {f"{prefix}.{e}.{proj}.weight": PackedWeight(fmt, rows[e], (N, K)) for e in range(E)}
    return {f"{prefix}.{e}.{proj}.weight": data[e].contiguous() for e in range(E)}


def shared_expert_gate(sd: dict[str, Any]) -> dict[str, Any]:
    """GGUF keeps Qwen2-MoE's shared-expert gate as a [hidden] vector; the model's is [1, hidden]."""
    return {k: (v.unsqueeze(0) if k.endswith("mlp.shared_expert_gate.weight") and v.dim() == 1 else v)
            for k, v in sd.items()}
