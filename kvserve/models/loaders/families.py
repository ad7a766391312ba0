"""What the dense families beyond Llama (Qwen3, Phi-3 / Phi-4-mini, OLMo-2, SmolLM3, Granite)
add to a config and to a checkpoint's names, read from a Hugging Face config.json or from a GGUF
file's metadata (the keys and tensor names llama.cpp's converter writes). hf.py and gguf.py
call these; each family's model is in kvserve/models/<family>.py."""

from __future__ import annotations

from typing import Any, Callable, Optional

import math

import torch

from kvserve.models.loaders.base import ModelLoadError

# config.json's `architectures` and `model_type` -> kvserve's name
HF_ARCHS = {"Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2",
            "SmolLM3ForCausalLM": "smollm3", "GraniteForCausalLM": "granite"}
HF_MODEL_TYPES = {"qwen3": "qwen3", "phi3": "phi3", "olmo2": "olmo2", "smollm3": "smollm3", "granite": "granite"}
GGUF_ARCHS = ("qwen3", "phi3", "olmo2", "smollm3", "granite")
GGUF_PERMUTED = ("smollm3", "granite")  # converted as Llama: q/k rows in interleaved pairs
GGUF_LAYER_RENAMES = {  # per architecture, over gguf.py's common table
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    "olmo2": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
              "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
SMOLLM3_NOPE_INTERVAL = 4  # llama.cpp's rule for smollm3 files, which carry no list
UNSERVED_ROPE = ("longrope", "su", "yarn", "dynamic")  # (Phi-3's longrope / su: served, models/phi3.py)
Get = Callable[..., Any]  # (key, kind, default) for config.json; (key, default) for GGUF metadata


def nope_every(interval: int, num_layers: int) -> tuple[int, ...]:
    """Layers without RoPE when every interval-th has none: interval 4, 8 layers -> (3, 7)."""
    if interval < 1:
        raise ModelLoadError(f"no_rope_layer_interval must be >= 1, got {interval}")
    return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)


def hf_fields(c: Any, arch: str, head_dim: int, num_layers: int,
              scaling: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The ModelConfig fields config.json gives this family beyond Llama's (c: hf._Fields); {}
    for the families not named here."""
    if arch not in HF_MODEL_TYPES:
        return {}
    if c.get("mlp_bias", bool, False):
        raise ModelLoadError(f"{c.path}: mlp_bias true is not supported ({arch} models publish none)")
    if arch == "phi3":
        factor = c.get("partial_rotary_factor", float, c.section("rope_parameters").get(
            "partial_rotary_factor", float, 1.0))
        if not 0 < factor <= 1:
            raise ModelLoadError(f"{c.path}: field 'partial_rotary_factor' must be in (0, 1], got {factor}")
        rotary_dim = int(head_dim * factor)
        return {"rotary_dim": rotary_dim, **_longrope(c, scaling, rotary_dim)}
    if arch == "smollm3":
        flags = c.get("no_rope_layers", list, None)
        if flags is None:
            nope = nope_every(c.get("no_rope_layer_interval", int, SMOLLM3_NOPE_INTERVAL), num_layers)
        elif len(flags) != num_layers or any(f not in (0, 1) or isinstance(f, bool) for f in flags):
            raise ModelLoadError(f"{c.path}: field 'no_rope_layers' must hold 1 (RoPE) or 0 (none) for each "
                                 f"of the {num_layers} layers, got {flags!r}")
        else:
            nope = tuple(i for i, f in enumerate(flags) if f == 0)
        return {"nope_layers": nope, "tie_word_embeddings": c.get("tie_word_embeddings", bool, True)}
    if arch == "granite":
        return {"embedding_multiplier": c.get("embedding_multiplier", float, 1.0),
                "attention_multiplier": c.get("attention_multiplier", float, 1.0),
                "residual_multiplier": c.get("residual_multiplier", float, 1.0),
                "logits_scaling": c.get("logits_scaling", float, 1.0)}
    return {}


def _longrope(c: Any, scaling: Optional[dict[str, Any]], rotary_dim: int) -> dict[str, Any]:
    """Phi-3's longrope (or su) scaling as models/phi3.LongRopeEmbedding reads it: both factor
    lists, the original length and the attention factor (transformers' default where the config
    gives none: sqrt(1 + ln(max / original) / ln(original)), 1 where max <= original)."""
    s = scaling or {}
    if s.get("rope_type", s.get("type")) not in ("longrope", "su"):
        return {}
    original = s.get("original_max_position_embeddings") or c.get("original_max_position_embeddings", int)
    factors = {k: s.get(k) for k in ("short_factor", "long_factor")}
    for key, values in factors.items():
        if not isinstance(values, list) or len(values) != rotary_dim // 2 or \
                not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
            raise ModelLoadError(f"{c.path}: longrope's {key} must list {rotary_dim // 2} numbers > 0 "
                                 f"(one per rotary frequency), got {values!r}")
    factor = s.get("factor") or c.get("max_position_embeddings", int, original) / original
    attention = s.get("attention_factor") or \
        (1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original)))
    return {"rope_scaling": {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(original),
                             "attention_factor": float(attention)}}


def check_rope_scaling(where: str, arch: str, scaling: Optional[dict[str, Any]]) -> None:
    """A clear refusal, for these families, of the RoPE scalings kvserve does not compute
    (longrope / su: Phi-3's 128k models and Phi-4-mini; yarn; dynamic NTK)."""
    if arch not in HF_MODEL_TYPES:
        return
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in UNSERVED_ROPE and not (arch == "phi3" and kind in ("longrope", "su")):
        raise ModelLoadError(f"{where}: rope scaling {kind!r} is not supported; supported: default, linear, llama3")


def split_fused(sd: dict[str, Any], num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, Any]:
    """Phi-3's fused products as Llama's: qkv_proj rows -> q_proj | k_proj | v_proj, gate_up_proj
    rows -> gate_proj | up_proj (halves). Works on tensors and on packed weights (rows move whole)."""
    sizes = {"self_attn.qkv_proj": [("self_attn.q_proj", num_heads * head_dim),
                                    ("self_attn.k_proj", num_kv_heads * head_dim),
                                    ("self_attn.v_proj", num_kv_heads * head_dim)]}
    out: dict[str, Any] = {}
    for name, w in sd.items():
        fused = next((f for f in ("self_attn.qkv_proj", "mlp.gate_up_proj") if f".{f}." in name), None)
        if fused is None:
            out[name] = w
            continue
        half = w.shape[0] // 2
        parts = sizes.get(fused, [("mlp.gate_proj", half), ("mlp.up_proj", half)])
        if sum(n for _, n in parts) != w.shape[0]:
            raise ModelLoadError(f"{name}: {w.shape[0]} rows, not the {sum(n for _, n in parts)} its parts need")
        start = 0
        for part, rows in parts:
            out[name.replace(fused, part)] = _rows(w, start, start + rows)
            start += rows
    return out


def _rows(w: Any, start: int, end: int) -> Any:
    """Rows [start, end) of a tensor (a copy) or of a packed weight."""
    if isinstance(w, torch.Tensor):
        return w[start:end].clone()
    return w.take_rows(torch.arange(start, end))


def gguf_fields(get: Get, arch: str, head_dim: int, num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields a GGUF file's metadata gives this family beyond Llama's."""
    if arch == "phi3":
        return {"rotary_dim": int(get("rope.dimension_count", head_dim))}
    if arch == "smollm3":
        return {"nope_layers": nope_every(SMOLLM3_NOPE_INTERVAL, num_layers)}
    if arch == "granite":
        return {"embedding_multiplier": float(get("embedding_scale", 1.0)),
                "attention_multiplier": float(get("attention.scale", 1.0)),
                "residual_multiplier": float(get("residual_scale", 1.0)),
                "logits_scaling": float(get("logit_scale", 1.0))}
    return {}


def gguf_longrope(path: str, get: Get, rotary_dim: int, factors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A Phi-3 file's longrope scaling ({} where it has none): the factors as tensors
    rope_factors_long / _short, the original length and the attention factor as metadata
    (llama.cpp writes the factor; where it is missing, transformers' default)."""
    if not factors:
        return {}
    names = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
    original = get("rope.scaling.original_context_length")
    if set(factors) != set(names.values()) or original is None:
        raise ModelLoadError(f"{path}: longrope needs tensors rope_factors_long and rope_factors_short and "
                             f"metadata rope.scaling.original_context_length; found {sorted(factors)}, "
                             f"original length {original}")
    lists = {key: factors[name].reshape(-1).tolist() for key, name in names.items()}
    if any(len(v) != rotary_dim // 2 for v in lists.values()):
        raise ModelLoadError(f"{path}: rope factors must hold {rotary_dim // 2} values (one per rotary frequency)")
    factor = float(get("context_length", original)) / float(original)
    attention = get("rope.scaling.attn_factor") or \
        (1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(float(original))))
    return {"rope_type": "longrope", **lists, "original_max_position_embeddings": int(original),
            "attention_factor": float(attention)}
